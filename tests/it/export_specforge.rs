//! `spool export --format specforge|specforge-chat`, read back by SpecForge's own data code
//! (tests/python/specforge_load.py): a real run against a mock that sends Qwen3's real
//! token ids, multi-turn chats regenerated with `turns = "all"` and `samples = 2`.

use crate::support::*;
use serde_json::{json, Value};
use spool::mock::MockConfig;
use spool::output::export::{ExportOptions, ExportReport, Format};
use spool::store::row::ShardRow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const IM_END: u32 = 151645;
/// `<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n` in Qwen3's ids: the
/// system turn SpecForge's parser adds when a conversation has none.
const DEFAULT_SYSTEM: [u32; 11] = [
    151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
];
/// `<|im_start|>system`: how a rendered system turn starts.
const SYSTEM_HEAD: [u32; 2] = [151644, 8948];

fn qwen_dir() -> PathBuf {
    fixtures().join("tokenizers/qwen3")
}

fn export(cfg: &spool::config::Config, format: Format, out: &Path, per_turn: bool) -> ExportReport {
    spool::output::export::export(
        cfg,
        &ExportOptions {
            per_turn,
            ..ExportOptions::new(format, out)
        },
    )
    .unwrap()
}

/// Multi-turn chats: user/assistant/user/assistant(/user), every third with a system turn.
fn write_multi(path: &Path, n: usize) {
    let mut s = String::new();
    for i in 0..n {
        let mut m = Vec::new();
        if i % 3 == 0 {
            m.push(json!({"role": "system", "content": "You are terse."}));
        }
        m.push(json!({"role": "user", "content": format!("Question {i}: why is the sky blue?")}));
        m.push(json!({"role": "assistant", "content": "source answer, never used"}));
        m.push(json!({"role": "user", "content": format!("And number {i}?")}));
        m.push(json!({"role": "assistant", "content": "another source answer"}));
        if i % 2 == 0 {
            m.push(json!({"role": "user", "content": "One more thing."}));
        }
        s.push_str(&json!({"id": format!("m{i}"), "messages": m}).to_string());
        s.push('\n');
    }
    std::fs::write(path, s).unwrap();
}

/// A run against a mock thinking in Qwen3's real tokens (`eos_in_ids` deciding whether it
/// sends `<|im_end|>`), prompts rendered client-side with `template`; each dataset is
/// (name, file, keys added to its table).
async fn run_with(
    dir: &Path,
    eos_in_ids: bool,
    template: &Path,
    datasets: &[(&str, &str, &str)],
) -> (spool::config::Config, Vec<ShardRow>) {
    let mock = Mock::start(MockConfig {
        think: true,
        tokenizer: Some(qwen_dir().join("tokenizer.json")),
        eos_in_ids,
        ..fast_mock()
    })
    .await;
    let table = format!(
        "[tokenizer]\npath = \"{}\"\nchat_template = \"{}\"\n",
        qwen_dir().join("tokenizer.json").display(),
        template.display()
    );
    let ds: Vec<Ds> = datasets
        .iter()
        .map(|(name, file, _)| Ds {
            name,
            file,
            budget: None,
        })
        .collect();
    let cfg_path = write_config(dir, &mock.url, "sglang", true, &ds, &table);
    let mut text = std::fs::read_to_string(&cfg_path).unwrap();
    for (name, file, keys) in datasets {
        let head = format!("name = \"{name}\"\npath = \"{file}\"\n");
        text = text.replace(&head, &format!("{head}{keys}"));
    }
    std::fs::write(&cfg_path, text).unwrap();
    run_to_end(&cfg_path).await;
    mock.stop().await;
    let out = dir.join("out");
    let rows: Vec<ShardRow> = datasets
        .iter()
        .flat_map(|(d, _, _)| shard_rows(&out, d))
        .collect();
    (load(&cfg_path), rows)
}

/// A run of three datasets (multi-turn with `turns = "all"` and `samples = 2`, short
/// single-turn chats cut by `max_tokens = 24`, plain prompts) with Qwen3's own template.
async fn run(dir: &Path, eos_in_ids: bool) -> (spool::config::Config, Vec<ShardRow>) {
    write_multi(&dir.join("multi.jsonl"), 12);
    write_chats(&dir.join("short.jsonl"), "s", 10);
    write_prompts(&dir.join("plain.jsonl"), "p", 6);
    run_with(
        dir,
        eos_in_ids,
        &qwen_dir().join("tokenizer_config.json"),
        &[
            ("multi", "multi.jsonl", "turns = \"all\"\nsamples = 2\n"),
            (
                "short",
                "short.jsonl",
                "[dataset.sampling]\nmax_tokens = 24\n",
            ),
            ("plain", "plain.jsonl", ""),
        ],
    )
    .await
}

/// Runs tests/python/specforge_load.py; fails with its stderr when it fails.
fn specforge_load(args: &[&str], cache: &Path) -> Vec<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/specforge_load.py");
    let out = Command::new("python3")
        .arg(&script)
        .args(args)
        .env("HF_DATASETS_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .expect("python3 must be installed (with specforge 0.2.0, datasets, transformers, torch)");
    assert!(
        out.status.success(),
        "specforge_load.py {args:?} failed (SpecForge 0.2.0, datasets, transformers and torch must be installed):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["rows"].as_array().unwrap().clone()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Spool's ids and mask for a shard row: prompt ++ completion, `<|im_end|>` appended to a
/// stopped turn that lacks it.
fn spool_ids(r: &ShardRow) -> (Vec<u32>, Vec<u32>) {
    let p = r.prompt_token_ids.clone().unwrap();
    let mut c = r.completion_token_ids.clone().unwrap();
    if r.finish_reason == "stop" && c.last() != Some(&IM_END) {
        c.push(IM_END);
    }
    let mask = [vec![0; p.len()], vec![1; c.len()]].concat();
    ([p, c].concat(), mask)
}

/// The end-of-turn rule on shard rows and the `specforge` lines made of them: a stopped
/// completion ends with exactly one `<|im_end|>`, a cut one has none.
fn check_end_of_turn(rows: &[ShardRow], lines: &[Value], server_sent_it: bool) -> (usize, usize) {
    let (mut stops, mut cuts) = (0, 0);
    for (r, l) in rows.iter().zip(lines) {
        let p = r.prompt_token_ids.as_ref().unwrap().len();
        let ids = u32s(&l["input_ids"]);
        let c = &ids[p..];
        let sent = r.completion_token_ids.as_ref().unwrap();
        assert_eq!(
            r.completion_tokens as usize,
            sent.len(),
            "{}: the count agrees with the ids",
            r.id
        );
        match r.finish_reason.as_str() {
            "stop" => {
                stops += 1;
                assert_eq!(c.last(), Some(&IM_END), "{}", r.id);
                assert_eq!(c.iter().filter(|&&t| t == IM_END).count(), 1, "{}", r.id);
                assert_eq!(sent.last() == Some(&IM_END), server_sent_it, "{}", r.id);
            }
            "length" => {
                cuts += 1;
                assert!(
                    !c.contains(&IM_END),
                    "{}: a cut turn gets no end of turn",
                    r.id
                );
                assert_eq!(c.len(), sent.len(), "{}", r.id);
            }
            other => panic!("{}: finish_reason {other}", r.id),
        }
    }
    (stops, cuts)
}

/// `specforge` lines load through SpecForge's pre-tokenized path (`prepare_prompt_tasks`)
/// as exactly spool's ids and loss mask, line for line; ids are unique; every stopped
/// completion ends with one `<|im_end|>` and none is added to a cut one, whether or not
/// the server sent it; and encoding a completion's text with Qwen3 gives back its ids
/// (the mock sends real tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specforge_ids_load_in_specforge_token_for_token() {
    let tok =
        spool::prompt::tokenizer::Tokenizer::from_file(&qwen_dir().join("tokenizer.json")).unwrap();
    for eos_in_ids in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, rows) = run(dir.path(), eos_in_ids).await;
        // 12 conversations × 2 samples × 2–3 turns, 10 short chats, 6 prompts.
        assert_eq!(rows.len(), 12 * 2 * 2 + 6 * 2 + 10 + 6, "rows");
        for r in &rows {
            let mut c = r.completion_token_ids.clone().unwrap();
            if c.last() == Some(&IM_END) {
                c.pop();
            }
            let raw = tok.decode(&c).unwrap();
            assert_eq!(
                tok.encode(&raw, false).unwrap(),
                c,
                "{}: text and ids agree",
                r.id
            );
            assert!(raw.starts_with("<think>\n"), "{}: {raw:?}", r.id);
        }
        let path = dir.path().join("sf.jsonl");
        let rep = export(&cfg, Format::Specforge, &path, false);
        assert_eq!(rep.accounting.kept(), rows.len() as u64);
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), rows.len());
        let ids: std::collections::HashSet<&str> =
            lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
        assert_eq!(ids.len(), lines.len(), "ids are unique");
        assert!(ids.contains("m0_s1_t2") && ids.contains("s0") && ids.contains("p5"));

        let (stops, cuts) = check_end_of_turn(&rows, &lines, eos_in_ids);
        assert!(stops > 40 && cuts >= 5, "{stops} stopped, {cuts} cut");

        let sf = specforge_load(&["ids", path.to_str().unwrap()], dir.path());
        assert_eq!(sf.len(), rows.len());
        for ((r, l), s) in rows.iter().zip(&lines).zip(&sf) {
            let (want_ids, want_mask) = spool_ids(r);
            assert_eq!(s["id"], l["id"]);
            assert_eq!(u32s(&s["input_ids"]), want_ids, "{}", l["id"]);
            assert_eq!(u32s(&s["loss_mask"]), want_mask, "{}", l["id"]);
        }
    }
}

/// How a SpecForge rendering of a `specforge-chat` line differs from spool's ids for the
/// conversation's last turn, after the expected differences are taken off.
#[derive(Debug, Default)]
struct Diffs {
    rows: usize,
    identical: usize,
    default_system: usize,
    newline_after_end: usize,
    cut_turn_closed: usize,
    earlier_turns_in_loss: usize,
    think_open_out_of_loss: usize,
    /// `prompt` rows: spool sent the raw text, SpecForge renders it as a user turn; only
    /// the completion is shared.
    raw_prompt: usize,
}

/// Compares SpecForge's rendering of each chat line (`sf`) with spool's ids for the last
/// turn of that line's sample; panics on any difference not classified.
fn classify(sf: &[Value], last: &HashMap<String, &ShardRow>) -> Diffs {
    let mut d = Diffs::default();
    for s in sf {
        let id = s["id"].as_str().unwrap();
        let r = last[id];
        d.rows += 1;
        let (want, want_mask) = spool_ids(r);
        let (mut ids, mut mask) = (u32s(&s["input_ids"]), u32s(&s["loss_mask"]));
        if ids == want && mask == want_mask {
            d.identical += 1;
            continue;
        }
        if r.messages.is_none() {
            d.raw_prompt += 1;
            let mut c = r.completion_token_ids.clone().unwrap();
            if c.last() == Some(&IM_END) {
                c.pop();
            }
            let at = ids.windows(c.len()).position(|w| w == &c[..]);
            let at = at.unwrap_or_else(|| panic!("{id}: the completion is not in SpecForge's ids"));
            // (A header ending with `<think>\n` leaves those two out of the loss.)
            let skip = if c.starts_with(&[151667, 198]) { 2 } else { 0 };
            assert!(
                mask[at + skip..at + c.len()].iter().all(|&m| m == 1),
                "{id}"
            );
            continue;
        }
        if !want.starts_with(&SYSTEM_HEAD) && ids.starts_with(&DEFAULT_SYSTEM) {
            d.default_system += 1;
            ids.drain(..DEFAULT_SYSTEM.len());
            mask.drain(..DEFAULT_SYSTEM.len());
        }
        if ids.ends_with(&[IM_END, 198]) && !want.ends_with(&[IM_END, 198]) {
            d.newline_after_end += 1;
            assert_eq!(mask.last(), Some(&1), "{id}: the newline is in the loss");
            ids.pop();
            mask.pop();
        }
        let p = r.prompt_token_ids.as_ref().unwrap().len();
        if r.finish_reason == "length" {
            // The template closes a cut turn: `\n</think>\n\n` and `<|im_end|>` follow.
            d.cut_turn_closed += 1;
            assert!(ids.starts_with(&want), "{id}: spool's cut turn is a prefix");
            assert_eq!(ids.last(), Some(&IM_END), "{id}");
            ids.truncate(want.len());
            mask.truncate(want.len());
        }
        assert_eq!(
            ids, want,
            "{id}: ids differ beyond the classified differences"
        );
        if mask[..p].contains(&1) {
            // SpecForge trains on every assistant turn of the conversation; spool's row
            // on the last one. Those spans are earlier assistant turns: after a
            // `<|im_start|>assistant\n` header, through `<|im_end|>\n`.
            d.earlier_turns_in_loss += 1;
            assert!(r.turn > 0, "{id}: loss in the prompt of a first turn");
            for (i, _) in mask[..p].iter().enumerate().filter(|(_, &m)| m == 1) {
                let head = ids[..i].iter().rposition(|&t| t == 151644).unwrap();
                assert_eq!(
                    ids[head + 1],
                    77091,
                    "{id}: loss at {i} outside an assistant turn"
                );
            }
        }
        let mut tail = mask[p..].to_vec();
        if tail.starts_with(&[0, 0]) && ids[p..].starts_with(&[151667, 198]) {
            // A header that ends with `<think>\n` leaves those two ids out of the loss.
            d.think_open_out_of_loss += 1;
            tail[0] = 1;
            tail[1] = 1;
        }
        assert!(
            tail.iter().all(|&m| m == 1),
            "{id}: completion out of the loss"
        );
    }
    d
}

/// `specforge-chat` (and `--per-turn`) lines go through SpecForge's own chat-template
/// preprocessing with Qwen3's template; what comes out is spool's ids for each line's last
/// turn except for differences that are each counted and asserted: SpecForge's default
/// system turn, the `\n` it renders after the final `<|im_end|>`, a cut turn closed by the
/// template, and the loss on earlier assistant turns (gone with `train_only_last_turn`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specforge_chat_renders_in_specforge_as_spool_generated_it() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, rows) = run(dir.path(), false).await;
    let path = dir.path().join("chat.jsonl");
    export(&cfg, Format::SpecforgeChat, &path, false);
    let lines: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // One line per (item, sample).
    assert_eq!(lines.len(), 12 * 2 + 10 + 6);
    // The last kept turn of each line's sample.
    let mut last: HashMap<String, &ShardRow> = HashMap::new();
    for r in &rows {
        let id = if r.dataset == "multi" {
            format!("{}_s{}", r.id, r.sample)
        } else {
            r.id.clone()
        };
        let e = last.entry(id).or_insert(r);
        if r.turn > e.turn {
            *e = r;
        }
    }
    assert_eq!(last.len(), lines.len());
    // Every generated assistant turn carries its own reasoning.
    for l in &lines {
        let conv = l["conversations"].as_array().unwrap();
        let id = l["id"].as_str().unwrap();
        let generated = conv.iter().filter(|m| m["role"] == "assistant").count();
        assert_eq!(generated, last[id].turn as usize + 1, "{id}");
        for m in conv.iter().filter(|m| m["role"] == "assistant") {
            assert!(m["reasoning_content"].is_string(), "{id}: {m}");
        }
    }

    let tdir = qwen_dir();
    let tdir = tdir.to_str().unwrap();
    let p = path.to_str().unwrap();
    let mut report = Vec::new();
    for (template, last_only) in [
        ("qwen3-thinking", "0"),
        ("qwen3-thinking", "1"),
        ("qwen3.5", "0"),
    ] {
        let sf = specforge_load(&["chat", p, tdir, template, last_only], dir.path());
        assert_eq!(sf.len(), lines.len(), "{template}");
        let d = classify(&sf, &last);
        let multi_later = lines
            .iter()
            .filter(|l| last[l["id"].as_str().unwrap()].turn > 0)
            .count();
        let without_system = lines
            .iter()
            .filter(|l| {
                l["conversations"][0]["role"] != "system"
                    && last[l["id"].as_str().unwrap()].messages.is_some()
            })
            .count();
        let raw = last.values().filter(|r| r.messages.is_none()).count();
        assert_eq!(d.raw_prompt, raw, "{template}");
        let cut = last
            .values()
            .filter(|r| r.finish_reason == "length" && r.messages.is_some())
            .count();
        assert_eq!(d.rows, lines.len());
        assert_eq!(d.cut_turn_closed, cut, "{template}");
        assert!(cut >= 5);
        assert_eq!(
            d.newline_after_end + d.identical + d.raw_prompt,
            d.rows,
            "{template}: {d:?}"
        );
        match template {
            "qwen3-thinking" => {
                assert_eq!(d.default_system, without_system, "{template}")
            }
            _ => assert_eq!(d.default_system, 0, "{template}"),
        }
        let earlier = if template == "qwen3-thinking" && last_only == "0" {
            multi_later
        } else {
            0
        };
        assert_eq!(
            d.earlier_turns_in_loss, earlier,
            "{template} {last_only}: {d:?}"
        );
        let think_open = if template == "qwen3.5" {
            d.rows - raw
        } else {
            0
        };
        assert_eq!(d.think_open_out_of_loss, think_open, "{template}: {d:?}");
        report.push(format!(
            "{template} train_only_last_turn={last_only}: {d:?}"
        ));
    }
    // The figures the README quotes.
    println!("specforge-chat vs spool ids:\n{}", report.join("\n"));

    // --per-turn: one line per generated turn, each the turn's own ids.
    let per = dir.path().join("per.jsonl");
    export(&cfg, Format::SpecforgeChat, &per, true);
    let sf = specforge_load(
        &["chat", per.to_str().unwrap(), tdir, "qwen3-thinking", "0"],
        dir.path(),
    );
    assert_eq!(sf.len(), rows.len());
    let mut by_turn: HashMap<String, &ShardRow> = HashMap::new();
    for r in &rows {
        let base = if r.dataset == "multi" {
            format!("{}_s{}", r.id, r.sample)
        } else {
            r.id.clone()
        };
        by_turn.insert(format!("{base}#turn{}", r.turn), r);
    }
    let d = classify(&sf, &by_turn);
    assert_eq!(
        d.newline_after_end + d.identical + d.raw_prompt,
        rows.len(),
        "{d:?}"
    );
    // Earlier assistant turns are in SpecForge's loss here too (visible content only).
    let later = rows.iter().filter(|r| r.turn > 0).count();
    assert_eq!(d.earlier_turns_in_loss, later, "{d:?}");
    println!("specforge-chat --per-turn, qwen3-thinking: {d:?}");
    // The README's recipe, `train_only_last_turn = true`: each line trains its own turn
    // and nothing else, so every generated turn is trained once.
    let sf = specforge_load(
        &["chat", per.to_str().unwrap(), tdir, "qwen3-thinking", "1"],
        dir.path(),
    );
    let d = classify(&sf, &by_turn);
    assert_eq!(d.rows, rows.len());
    assert_eq!(d.earlier_turns_in_loss, 0, "{d:?}");
    assert_eq!(
        d.newline_after_end + d.identical + d.raw_prompt,
        rows.len(),
        "{d:?}"
    );
    println!("specforge-chat --per-turn, qwen3-thinking, train_only_last_turn: {d:?}");
}

/// Qwen3's `<think>`.
const THINK_OPEN: u32 = 151667;

/// The template that renders an assistant turn's thinking wherever the message has it
/// (tests/fixtures/SOURCES.md), so `history_reasoning` changes what is sent.
fn history_template() -> PathBuf {
    fixtures().join("templates/qwen3-history-thinking.jinja")
}

/// The same conversations twice, `history_reasoning = "drop"` and `"keep"`, regenerated
/// with `turns = "all"` and rendered client-side by [`history_template`]; and plain prompts.
async fn run_history(dir: &Path) -> (spool::config::Config, Vec<ShardRow>) {
    write_multi(&dir.join("multi.jsonl"), 6);
    write_prompts(&dir.join("plain.jsonl"), "p", 3);
    run_with(
        dir,
        false,
        &history_template(),
        &[
            (
                "drop",
                "multi.jsonl",
                "turns = \"all\"\nhistory_reasoning = \"drop\"\n",
            ),
            (
                "keep",
                "multi.jsonl",
                "turns = \"all\"\nhistory_reasoning = \"keep\"\n",
            ),
            ("plain", "plain.jsonl", ""),
        ],
    )
    .await
}

/// `--per-turn` rows show the earlier turns exactly as they were sent back: through
/// SpecForge's own preprocessing (Qwen3 thinking template, `train_only_last_turn = true`,
/// the template the run rendered with), every line is the ids spool sent for that turn
/// and the ids generated, under `history_reasoning = "drop"` (no earlier thinking) and
/// `"keep"` (earlier thinking rendered, as sent) alike, and each line trains on its own
/// turn only: with this recipe every generated turn is trained once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_turn_history_is_what_was_sent_under_drop_and_keep() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, rows) = run_history(dir.path()).await;
    // 6 conversations of 2–3 turns, twice; 3 prompts.
    assert_eq!(rows.len(), 2 * (6 * 2 + 3) + 3);
    // What was sent differs: kept thinking is in the later turns' prompts, dropped is not.
    for r in rows.iter().filter(|r| r.turn > 0) {
        let thinks = r.prompt_token_ids.as_ref().unwrap().contains(&THINK_OPEN);
        assert_eq!(thinks, r.dataset == "keep", "{} {}", r.dataset, r.id);
    }
    let per = dir.path().join("per.jsonl");
    export(&cfg, Format::SpecforgeChat, &per, true);
    let template = history_template();
    let sf = specforge_load(
        &[
            "chat",
            per.to_str().unwrap(),
            qwen_dir().to_str().unwrap(),
            "qwen3-thinking",
            "1",
            template.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert_eq!(sf.len(), rows.len(), "one line per generated turn");
    // Ids are per dataset: the same conversation is in both.
    let mut by_turn: HashMap<String, &ShardRow> = HashMap::new();
    let lines: Vec<Value> = std::fs::read_to_string(&per)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut sf_named = Vec::new();
    for (r, (l, s)) in rows.iter().zip(lines.iter().zip(&sf)) {
        let key = format!("{}/{}", r.dataset, l["id"].as_str().unwrap());
        assert_eq!(
            l["id"].as_str().unwrap(),
            format!("{}#turn{}", r.id, r.turn),
            "lines in row order"
        );
        by_turn.insert(key.clone(), r);
        let mut s = s.clone();
        s["id"] = json!(key);
        sf_named.push(s);
    }
    let d = classify(&sf_named, &by_turn);
    assert_eq!(d.earlier_turns_in_loss, 0, "{d:?}");
    assert_eq!(
        d.identical + d.newline_after_end + d.raw_prompt,
        rows.len(),
        "{d:?}"
    );
    println!("--per-turn under drop and keep, qwen3-thinking, train_only_last_turn: {d:?}");
}

/// Runs one of SpecForge's data scripts (tests/fixtures/specforge) with `args`: its exit
/// status, stdout and stderr.
fn specforge_script(name: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("python3")
        .arg(fixtures().join("specforge").join(name))
        .args(args)
        .output()
        .expect("python3");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The content rules of SpecForge's expansion (`conversation_validation.py` and
/// `expand_reasoning_conversations.py`): the only reasons a spool row may be skipped.
const CONTENT_RULES: [&str; 6] = [
    "Invalid message content at position",
    "Invalid assistant reasoning_content at position",
    "Invalid message role",
    "Invalid conversation role order",
    "Conversation ends with a user message",
    "Data does not contain",
];

/// Expands `chat` with SpecForge's script and checks it against spool's `--per-turn`
/// export of the same rows (`per`): rows are skipped only for SpecForge's content rules,
/// every accepted conversation gives one event per assistant turn, and each event is
/// spool's line of the same id (history dropped, as the expansion assumes). Returns
/// (events, skipped rows).
fn expand_and_compare(dir: &Path, chat: &Path, per: &Path, tag: &str) -> (usize, usize) {
    let events_path = dir.join(format!("events-{tag}.jsonl"));
    let skipped_path = dir.join(format!("skipped-{tag}.jsonl"));
    let (ok, stdout, stderr) = specforge_script(
        "expand_reasoning_conversations.py",
        &[
            "--input-file-path",
            chat.to_str().unwrap(),
            "--output-file-path",
            events_path.to_str().unwrap(),
            "--skipped-file-path",
            skipped_path.to_str().unwrap(),
        ],
    );
    assert!(ok, "{tag}: expansion failed: {stdout}{stderr}");
    let events = read_jsonl(&events_path);
    let skipped = read_jsonl(&skipped_path);
    for s in &skipped {
        let why = s["error"].as_str().unwrap();
        assert!(
            CONTENT_RULES.iter().any(|r| why.starts_with(r)),
            "{tag}: {} skipped for {why:?}, not a content rule",
            s["id"]
        );
    }
    let conversations = read_jsonl(chat);
    let accepted: std::collections::HashSet<&str> = conversations
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .filter(|id| !skipped.iter().any(|s| s["id"] == *id))
        .collect();
    let assistant_turns: usize = conversations
        .iter()
        .filter(|c| accepted.contains(c["id"].as_str().unwrap()))
        .map(|c| {
            c["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["role"] == "assistant")
                .count()
        })
        .sum();
    assert_eq!(
        events.len(),
        assistant_turns,
        "{tag}: one event per assistant turn"
    );
    let spool: HashMap<String, Value> = read_jsonl(per)
        .into_iter()
        .map(|l| (l["id"].as_str().unwrap().to_string(), l))
        .collect();
    let mine = spool
        .values()
        .filter(|l| accepted.contains(l["source_id"].as_str().unwrap()))
        .count();
    assert_eq!(mine, events.len(), "{tag}: --per-turn has the same events");
    for e in &events {
        let id = e["id"].as_str().unwrap();
        let l = &spool[id];
        for k in [
            "id",
            "source_id",
            "source_row_index",
            "assistant_turn_index",
            "conversations",
            "status",
        ] {
            assert_eq!(e[k], l[k], "{tag}: {id}: `{k}`");
        }
    }
    (events.len(), skipped.len())
}

/// SpecForge's own `validate_regenerated_data.py` passes on spool's `specforge-chat`
/// export, and its `expand_reasoning_conversations.py` turns it into one event per
/// assistant turn of every conversation, the same events as spool's `--per-turn`; rows it
/// skips (a turn cut inside its thinking has no answer) are skipped for its own content
/// rules only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specforge_scripts_validate_and_expand_spools_export() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, rows) = run(dir.path(), false).await;
    let gated = |format, out: &Path, per_turn, exclude: &[&str]| {
        spool::output::export::export(
            &cfg,
            &ExportOptions {
                per_turn,
                gates: spool::output::export::Gates {
                    exclude_finish: exclude.iter().map(|s| s.to_string()).collect(),
                    ..Default::default()
                },
                ..ExportOptions::new(format, out)
            },
        )
        .unwrap()
    };
    // Without the cut turns: validation passes, and nothing is skipped.
    let chat = dir.path().join("chat.jsonl");
    let per = dir.path().join("per.jsonl");
    gated(Format::SpecforgeChat, &chat, false, &["length"]);
    gated(Format::SpecforgeChat, &per, true, &["length"]);
    let (ok, stdout, stderr) = specforge_script(
        "validate_regenerated_data.py",
        &["--data-path", chat.to_str().unwrap()],
    );
    assert!(ok, "validation failed: {stdout}{stderr}");
    assert!(stdout.contains("validation passed"), "{stdout}");
    let lines = read_jsonl(&chat).len();
    assert!(stdout.contains(&format!("rows: {lines}\n")), "{stdout}");
    let stopped = rows.iter().filter(|r| r.finish_reason != "length").count();
    let (events, skipped) = expand_and_compare(dir.path(), &chat, &per, "stopped");
    assert_eq!((events, skipped), (stopped, 0));

    // Every row: the turns cut inside their thinking have no answer, which SpecForge's
    // rules reject; the rest expand as spool's --per-turn.
    let chat = dir.path().join("chat-all.jsonl");
    let per = dir.path().join("per-all.jsonl");
    gated(Format::SpecforgeChat, &chat, false, &[]);
    gated(Format::SpecforgeChat, &per, true, &[]);
    let (events, skipped) = expand_and_compare(dir.path(), &chat, &per, "all");
    assert!(
        skipped > 0 && events >= stopped,
        "{events} events, {skipped} skipped"
    );
    println!(
        "SpecForge expansion of spool's export: {events} events, {skipped} conversations skipped"
    );
}
