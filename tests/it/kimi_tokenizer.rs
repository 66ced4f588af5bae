//! Kimi's tiktoken tokenizer against Python `tiktoken` built as Moonshot's
//! `tokenization_kimi.py` builds it (tests/python/kimi_oracle.py), id for id, and a real
//! job whose `[tokenizer] path` is the Kimi model folder.
//!
//! The oracle gives three paths: transformers' `tokenizer(text)` around a class shaped as
//! the vendor's (the server's path: vLLM prompts, every chat rendering), the vendor's
//! `encode(text)` (SGLang's raw-text path), and plain `Encoding.encode`. spool must give
//! the first, always; the three agree on text of at most 25,000 characters, and the test
//! counts where they part on longer text. With `SPOOL_KIMI_VENDOR_PY` naming a
//! `tokenization_kimi.py`, the vendor's own class runs too and must agree.

use std::path::{Path, PathBuf};
use std::process::Command;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use spool::mock::MockConfig;
use spool::prompt::Tokenizer;

use crate::support::{fast_mock, fixtures, run_to_end, shard_rows, write_config, Ds, Mock};

fn kimi_dir() -> PathBuf {
    fixtures().join("tokenizers/kimi-k2")
}

/// One case for the oracle: a text to encode, or ids to decode.
enum Case {
    Text(String),
    Ids(Vec<u32>),
}

/// Runs the oracle on `cases`; returns its header line and one result per case.
fn oracle(cases: &[Case], work: &Path) -> (Value, Vec<Value>) {
    let input = work.join("cases.jsonl");
    let output = work.join("out.jsonl");
    let mut s = String::new();
    for c in cases {
        let v = match c {
            Case::Text(t) => json!({ "text": t }),
            Case::Ids(ids) => json!({ "ids": ids }),
        };
        s.push_str(&v.to_string());
        s.push('\n');
    }
    std::fs::write(&input, s).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/kimi_oracle.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(kimi_dir()).arg(&input).arg(&output);
    if let Ok(vendor) = std::env::var("SPOOL_KIMI_VENDOR_PY") {
        cmd.arg("--vendor").arg(vendor);
    }
    let out = cmd
        .env("HF_HUB_OFFLINE", "1")
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .expect("python3 must be installed (with tiktoken and transformers)");
    assert!(
        out.status.success(),
        "kimi_oracle.py failed (it needs tiktoken and transformers):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&output).unwrap();
    let mut lines = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap());
    let head = lines.next().expect("the oracle's header line");
    let results: Vec<Value> = lines.collect();
    assert_eq!(results.len(), cases.len(), "one result per case");
    (head, results)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The fixed texts: every class the pattern and the vendor's handling distinguish.
fn fixed_texts() -> Vec<String> {
    let mut v: Vec<String> = [
        "",
        "Hello, world!",
        "中文和English混合的句子，带标点。Kimi 是月之暗面开发的模型。",
        "日本語のテキストとカタカナ、한국어 문장도 있습니다. Ελληνικά και Кириллица.",
        "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\"); // done\n}\n",
        "def f(a, b):\n\treturn a ** 2 + b  # ½ ²\n\n\nclass A:\n    pass\r\n",
        "😀 👍🏽 👩🏿‍💻 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🏳️‍🌈 ❤️ 1️⃣ ☃\u{fe0f}",
        "Cafe\u{301} cre\u{300}me bru\u{302}le\u{301}e A\u{30a}ngstro\u{308}m n\u{303}",
        "\u{301}\u{301}a \u{301} x\u{301}Y ʰʰ ǅungla ﬁﬂ ᾈ",
        "It's we'RE they'Ve I'M you'LL he'D 'S 'ſ x'Ll '",
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
        "<think>step one</think>answer<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}<|tool_call_end|><|tool_calls_section_end|>",
        "[BOS][EOS][EOT][UNK][PAD] [EO [EOS <|im_end <|im_end|| <|im_<|im_end|>end|>",
        "<|reserved_token_163589|><|reserved_token_163600|><|reserved_token_1|><|reserved_token_163840|>",
        "<|media_begin|>image<|media_content|><|media_pad|><|media_end|> <|start_header_id|>x<|end_header_id|>",
        "  leading  and trailing  \n\n\t x\r\n y \u{a0}z\u{3000}a   ",
        "\u{1c}\u{1d}\u{1e}\u{1f} sep \u{85}\u{2028}\u{2029} \u{200b}zw\u{200b} \u{feff}",
        "12345678 ٣٤٥٦٧ ０１２３ ⅷⅸ 〇一二三 ① 9,999.99",
        "，。！？「」『』【】…… —— ～",
        "\n\n\n   \n\t\t\n \r\n\r\n",
        "\u{0}\u{1}\u{7f}\u{e000}\u{10ffff}\u{fffd}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // NFD forms differ from NFC in bytes and ids: nothing normalises them.
    v.push("e\u{301}".repeat(40));
    v.push("\u{e9}".repeat(40));
    v
}

/// Texts past the vendor's limits: runs longer than 25,000 characters of each kind, Han
/// runs, special tokens inside long runs, text past 400,000 characters, and the
/// one-pass threshold at 25,000 bytes.
fn long_texts() -> Vec<String> {
    let para = "Kimi K2 是一个混合专家模型 (MoE) with 32B active parameters. \
                It's trained with Muon; see https://example.com/x?y=1&z=2 😀👍🏽.\n\
                fn f(x: u32) -> u32 { x * 2 }\n\n";
    let mut big = String::new();
    while big.chars().count() < 450_000 {
        big.push_str(para);
    }
    // A trie token straddling the first 400,000-character chunk boundary.
    let straddle = format!("{}<|im_end|>{}", "ab ".repeat(133_331), "cd ".repeat(100));
    assert!(straddle.chars().count() > 400_000);
    vec![
        "a".repeat(25_000),
        "a".repeat(25_001),
        "a".repeat(60_000),
        "é".repeat(12_500),
        "é".repeat(13_000),
        format!("{}x", " ".repeat(25_001)),
        format!("x{}y", "\n".repeat(30_000)),
        format!("{}a", "\u{1c}".repeat(26_000)),
        format!("{}end", "\t \u{a0}".repeat(9_000)),
        "中".repeat(30_000),
        format!("{}<|im_end|>{}", "x".repeat(20_000), "y".repeat(20_000)),
        format!("{}<think>{}", "x".repeat(20_000), "y".repeat(20_000)),
        format!("{}[EOS]{}", "-".repeat(24_998), "=".repeat(3)),
        "word ".repeat(6_000),
        big,
        straddle,
    ]
}

/// Fragments the generated texts are made of.
fn fragment(rng: &mut StdRng) -> String {
    const WORDS: &[&str] = &[
        "the",
        "Kimi",
        "HTTPServer",
        "iPhone",
        "naïve",
        "Straße",
        "ΑΘΗΝΑ",
        "москва",
        "Όλα",
        "mañana",
        "ǅ",
        "ﬁne",
        "x",
    ];
    const PUNCT: &[&str] = &[
        ".", ",", "!?", "...", "--", "(", ")", "[", "]", "{}", "\"", "#", "->", "::", "&&", "，",
        "。", "「", "」", "…", "%",
    ];
    const SPACES: &[&str] = &[
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u{a0}", "\u{3000}", "\u{2028}",
        "\u{85}", "\u{1c}", "\u{1f}", "\u{b}", "\u{c}", " \n ", "\u{200b}",
    ];
    const EMOJI: &[&str] = &[
        "😀",
        "👍🏽",
        "🇫🇷",
        "👨\u{200d}👩\u{200d}👧",
        "❤\u{fe0f}",
        "🏳\u{fe0f}\u{200d}🌈",
        "1\u{fe0f}\u{20e3}",
        "🧑🏿\u{200d}🚀",
    ];
    const CONTRACTIONS: &[&str] = &["'s", "'t", "'re", "'VE", "'m", "'LL", "'d", "'ſ", "'", "'x"];
    const SPECIAL: &[&str] = &[
        "<|im_end|>",
        "<|im_user|>",
        "<|im_middle|>",
        "[EOS]",
        "[BOS]",
        "<think>",
        "</think>",
        "<|tool_call_begin|>",
        "<|reserved_token_163600|>",
        "<|reserved_token_163700|>",
        "<|im_",
        "|>",
        "<|",
        "[EO",
        "<|reserved_token_",
        "<think",
        "[PAD]",
    ];
    const CODE: &[&str] = &[
        "fn main() {}",
        "x = [1, 2, 3]",
        "if (a<b && c>d) return -1;",
        "    ",
        "\t\t",
        "//",
        "/* c */",
        "a_b_c",
        "__init__",
        "0x1F",
    ];
    let pick = |rng: &mut StdRng, list: &[&str]| list[rng.random_range(0..list.len())].to_string();
    // 1 to `most - 1` code points drawn from `lo..=hi`.
    let range = |rng: &mut StdRng, lo: u32, hi: u32, most: usize| -> String {
        let n = rng.random_range(1..most);
        (0..n)
            .filter_map(|_| char::from_u32(rng.random_range(lo..=hi)))
            .collect()
    };
    match rng.random_range(0..16) {
        0 | 1 => pick(rng, WORDS),
        2 => range(rng, 0x61, 0x7a, 10),
        3 => range(rng, 0x4e00, 0x9fff, 6),
        4 => range(rng, 0x3041, 0x30ff, 5),
        5 => range(rng, 0xac00, 0xd7a3, 4),
        6 => {
            let base = range(rng, 0x41, 0x7a, 2);
            base + &range(rng, 0x300, 0x36f, 3)
        }
        7 => range(rng, 0x30, 0x39, 8),
        8 => pick(rng, PUNCT),
        9 => pick(rng, SPACES),
        10 => pick(rng, EMOJI),
        11 => pick(rng, CONTRACTIONS),
        12 => pick(rng, SPECIAL),
        13 => pick(rng, CODE),
        14 => range(rng, 0x370, 0x52f, 6),
        _ => (0..rng.random_range(1..4))
            .filter_map(|_| char::from_u32(rng.random_range(0..0x11_0000)))
            .collect(),
    }
}

/// spool's ids equal the server's path (transformers' `tokenizer(text)` around the
/// vendor-shaped class over Python `tiktoken`) for fixed texts of every class, for 3,000
/// generated texts mixing them, and for texts past the 25,000- and 400,000-character
/// limits; with and without special tokens; decode gives tiktoken's text; Python's
/// `isspace` is the set spool cuts runs by.
#[test]
fn kimi_ids_equal_python_tiktoken_built_as_moonshot_builds_it() {
    let tok = Tokenizer::from_file(&kimi_dir()).unwrap();
    assert!(tok.is_tiktoken());
    let mut rng = StdRng::seed_from_u64(0x4b1d1);
    let fixed = fixed_texts();
    let long = long_texts();
    let generated: Vec<String> = (0..3_000)
        .map(|_| {
            let n = rng.random_range(1..14);
            (0..n).map(|_| fragment(&mut rng)).collect()
        })
        .collect();
    // Id sequences to decode: random ids over the whole vocabulary (bytes that are not
    // UTF-8 on their own, special ids), and single byte tokens.
    let vocab = tok.vocab_size() as u32;
    let decodes: Vec<Vec<u32>> = (0..300)
        .map(|_| {
            (0..rng.random_range(0..12))
                .map(|_| match rng.random_range(0..3) {
                    0 => rng.random_range(0..256),
                    1 => rng.random_range(163_584..vocab),
                    _ => rng.random_range(0..163_584),
                })
                .collect()
        })
        .collect();
    let texts: Vec<&String> = fixed.iter().chain(&long).chain(&generated).collect();
    let mut cases: Vec<Case> = texts.iter().map(|t| Case::Text((*t).clone())).collect();
    cases.extend(decodes.iter().map(|d| Case::Ids(d.clone())));

    let work = tempfile::tempdir().unwrap();
    let (head, results) = oracle(&cases, work.path());

    // Python's str.isspace, code point by code point.
    let spaces: Vec<u32> = ids(&head["isspace"]);
    for c in (0..0x11_0000u32).filter_map(char::from_u32) {
        assert_eq!(
            spool::prompt::tiktoken::is_python_space(c),
            spaces.contains(&(c as u32)),
            "U+{:04X}",
            c as u32
        );
    }
    // The trie of the server's path is what spool cuts long text at first.
    assert_eq!(
        head["trie"],
        json!([
            "<|end_header_id|>",
            "<|im_assistant|>",
            "<|im_end|>",
            "<|im_middle|>",
            "<|im_system|>",
            "<|im_user|>",
            "<|start_header_id|>",
            "[BOS]",
            "[EOS]",
            "[EOT]",
            "[PAD]",
            "[UNK]"
        ])
    );
    let vendor = !head["vendor"].is_null();

    let mut failures = Vec::new();
    let (mut long_parted, mut vendor_parted, mut tokens) = (0usize, 0usize, 0usize);
    for (i, text) in texts.iter().enumerate() {
        let r = &results[i];
        let call = ids(&r["call"]);
        tokens += call.len();
        let short = text.chars().count() <= 25_000;
        let label = || {
            let shown: String = text.chars().take(60).collect();
            format!("case {i} ({} chars, {shown:?})", text.chars().count())
        };
        if tok.encode(text, false).unwrap() != call {
            failures.push(format!(
                "{}: encode differs from the server's path",
                label()
            ));
        }
        if tok.encode(text, true).unwrap() != ids(&r["call_special"])
            || tok.encode_prompt(text).unwrap() != ids(&r["call_special"])
        {
            failures.push(format!("{}: with special tokens, differs", label()));
        }
        if ids(&r["call_special"]) != call {
            failures.push(format!("{}: add_special_tokens added ids", label()));
        }
        let (encode, plain) = (ids(&r["encode"]), ids(&r["tiktoken"]));
        if short && (encode != call || plain != call) {
            failures.push(format!(
                "{}: the oracle's paths part under 25,000 characters",
                label()
            ));
        }
        if !short && encode != call {
            long_parted += 1;
        }
        let decoded = tok.decode(&call).unwrap();
        if decoded != r["decoded"].as_str().unwrap() || decoded != **text {
            failures.push(format!("{}: decode differs", label()));
        }
        if vendor && (ids(&r["vendor_call"]) != call || ids(&r["vendor_encode"]) != encode) {
            vendor_parted += 1;
            failures.push(format!("{}: the vendor's own class differs", label()));
        }
    }
    for (k, d) in decodes.iter().enumerate() {
        let want = results[texts.len() + k]["decoded"].as_str().unwrap();
        if tok.decode(d).unwrap() != want {
            failures.push(format!("decode of {d:?} differs"));
        }
    }
    println!(
        "kimi oracle: {} texts ({} generated, {} past 25,000 characters), {tokens} tokens, \
         {} id sequences decoded; vendor's own class: {}; the vendor's encode() path \
         (SGLang raw text) parts from the server's tokenizer() path on {long_parted} of the \
         long texts",
        texts.len(),
        generated.len(),
        long.len(),
        decodes.len(),
        if vendor {
            format!("differs on {vendor_parted} texts")
        } else {
            "not run (SPOOL_KIMI_VENDOR_PY unset)".to_string()
        },
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(tokens > 500_000, "the cases hold {tokens} tokens");
    // The cases do reach the paths where the vendor's two entry points part.
    assert!(long_parted >= 2, "{long_parted}");
}

/// A real job with `[tokenizer] path` naming the Kimi folder (no `chat_template` key: the
/// folder's template) against a mock sending Kimi ids: every row's prompt ids decode to
/// its rendered prompt and are the server path's ids for it; the prompt is Kimi's template;
/// completion ids are Kimi's and decode to the completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kimi_folder_runs_a_job_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(MockConfig {
        tokenizer: Some(kimi_dir()),
        ..fast_mock()
    })
    .await;
    let chats = dir.path().join("chat.jsonl");
    let mut s = String::new();
    for i in 0..12 {
        s.push_str(
            &json!({"id": format!("c{i}"), "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": format!("问题 {i}: why is the sky blue? 😀")}]})
            .to_string(),
        );
        s.push('\n');
    }
    std::fs::write(&chats, s).unwrap();
    let plain = dir.path().join("plain.jsonl");
    let mut s = String::new();
    for i in 0..6 {
        s.push_str(
            &json!({"id": format!("p{i}"), "prompt": format!("<|im_user|>user<|im_middle|>Tell me {i}.<|im_end|>")})
                .to_string(),
        );
        s.push('\n');
    }
    std::fs::write(&plain, s).unwrap();
    let table = format!("[tokenizer]\npath = \"{}\"\n", kimi_dir().display());
    let ds = |name, file| Ds {
        name,
        file,
        budget: None,
    };
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "sglang",
        false,
        &[ds("chat", "chat.jsonl"), ds("plain", "plain.jsonl")],
        &table,
    );
    run_to_end(&cfg).await;
    mock.stop().await;

    let tok = Tokenizer::from_file(&kimi_dir()).unwrap();
    let out = dir.path().join("out");
    let rows: Vec<_> = ["chat", "plain"]
        .iter()
        .flat_map(|d| shard_rows(&out, d))
        .collect();
    assert_eq!(rows.len(), 18);
    let c0 = rows.iter().find(|r| r.id == "c0").unwrap();
    assert_eq!(
        c0.prompt,
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|><|im_user|>user<|im_middle|>\
         问题 0: why is the sky blue? 😀<|im_end|><|im_assistant|>assistant<|im_middle|>"
    );
    let cases: Vec<Case> = rows.iter().map(|r| Case::Text(r.prompt.clone())).collect();
    let (_, want) = oracle(&cases, dir.path());
    for (row, want) in rows.iter().zip(&want) {
        let prompt_ids = row.prompt_token_ids.as_ref().expect("prompt ids");
        assert_eq!(tok.decode(prompt_ids).unwrap(), row.prompt, "{}", row.id);
        assert_eq!(prompt_ids, &ids(&want["call"]), "{}", row.id);
        assert_eq!(row.prompt_tokens as usize, prompt_ids.len(), "{}", row.id);
        assert!(
            prompt_ids.contains(&163_586),
            "{}: <|im_end|> is one id",
            row.id
        );
        let completion_ids = row.completion_token_ids.as_ref().expect("completion ids");
        assert!(!completion_ids.is_empty(), "{}", row.id);
        // Kimi's reasoning parser takes a reply without `</think>` as all thinking (SGLang's
        // rule for Kimi unless thinking is off); the mock writes no markers, so the split
        // text put back together is the whole reply.
        let text = format!(
            "{}{}",
            row.reasoning.as_deref().unwrap_or(""),
            row.completion
        );
        assert_eq!(tok.decode(completion_ids).unwrap(), text, "{}", row.id);
        assert_eq!(tok.encode(&text, false).unwrap(), *completion_ids);
    }
}
