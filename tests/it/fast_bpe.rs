//! The fast byte-level BPE encoder against HuggingFace `tokenizers` on the benchmark's
//! own prompts: `bench/tokenize/gen_prompts.py` rows (English, code, numbers, CJK,
//! accented text, system and multi-turn chats), rendered with Qwen3's template, must
//! encode to exactly the ids `tokenizers` gives, row by row.

use std::path::Path;
use std::process::Command;

use spool::input::row::{parse_row, Input};
use spool::prompt::{ChatTemplate, PromptBuilder, Tokenizer};

const ROWS: usize = 3000;

#[test]
fn bench_prompts_encode_to_the_huggingface_ids() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = root.join("tests/fixtures/tokenizers/qwen3");
    let tmp = tempfile::tempdir().unwrap();
    let prompts = tmp.path().join("prompts.jsonl");
    let status = Command::new("python3")
        .arg(root.join("bench/tokenize/gen_prompts.py"))
        .arg(ROWS.to_string())
        .arg(&prompts)
        .status()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed for gen_prompts.py): {e}"));
    assert!(status.success(), "gen_prompts.py failed");

    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert!(
        tokenizer.has_fast_encoder(),
        "Qwen3 must get the fast encoder"
    );
    let template = ChatTemplate::from_file(&dir.join("tokenizer_config.json")).unwrap();
    let builder = PromptBuilder::new(Some(template), Some(tokenizer));
    let reference = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();

    let text = std::fs::read_to_string(&prompts).unwrap();
    let (mut rows, mut tokens, mut failures) = (0usize, 0usize, Vec::new());
    for (i, line) in text.lines().enumerate() {
        let row = parse_row("bench", i as u64, line).unwrap();
        let built = match &row.input {
            Input::Messages(messages) => builder.build_chat(messages).unwrap(),
            Input::Prompt(prompt) => builder.build_text(prompt).unwrap(),
        };
        let ids = built.token_ids.unwrap();
        let want = reference.encode_fast(built.text.as_str(), false).unwrap();
        if ids != want.get_ids() {
            failures.push(format!("row {i}: {:?}", built.text));
        }
        rows += 1;
        tokens += ids.len();
    }
    assert_eq!(rows, ROWS);
    assert!(tokens > ROWS * 100, "{tokens} tokens for {rows} rows");
    assert!(
        failures.is_empty(),
        "{} rows differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
