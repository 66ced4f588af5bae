//! `make bench-tokenize-kimi`, the raw encoder half: spool's encoder for Kimi's tiktoken
//! vocabulary ([`spool::prompt::Tokenizer`] over a model folder) on one thread, over a
//! corpus of texts, as `bench/tokenize/kimi_reference.py` runs Python `tiktoken`.
//!
//! The corpus is read into memory before the clock starts; each pass encodes every text
//! once, in order, on this thread, keeping the ids (as the Python side keeps its lists).
//! Printed per pass (one JSON line): texts, UTF-8 bytes, tokens, seconds, and a checksum of
//! the ids computed after the clock stops (per text, Σ id × (position + 1), summed mod
//! 2⁶⁴), which the Python side computes the same way. The tokenizer's load is timed apart.
//!
//! usage: cargo run --release --example bench_kimi_encode -- MODEL_DIR CORPUS.jsonl [PASSES]
//!        (CORPUS: one {"text": ...} a line; PASSES default 3)
use spool::prompt::Tokenizer;
use std::path::Path;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, corpus) = match &args[..] {
        [d, c, ..] => (Path::new(d), Path::new(c)),
        _ => {
            eprintln!("usage: bench_kimi_encode MODEL_DIR CORPUS.jsonl [PASSES]");
            std::process::exit(2);
        }
    };
    let passes: usize = args.get(2).map_or(3, |p| p.parse().expect("PASSES"));
    let texts: Vec<String> = std::fs::read_to_string(corpus)
        .expect("read the corpus")
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            v["text"].as_str().expect("a text").to_string()
        })
        .collect();
    let bytes: usize = texts.iter().map(String::len).sum();
    let t = Instant::now();
    let tok = Tokenizer::from_file(dir).expect("load the tokenizer");
    println!(
        "{}",
        serde_json::json!({"load_seconds": t.elapsed().as_secs_f64(), "tiktoken": tok.is_tiktoken()})
    );
    for pass in 0..passes {
        let t = Instant::now();
        let all: Vec<Vec<u32>> = texts
            .iter()
            .map(|text| tok.encode(text, false).expect("encode"))
            .collect();
        let seconds = t.elapsed().as_secs_f64();
        let tokens: usize = all.iter().map(Vec::len).sum();
        let mut checksum = 0u64;
        for ids in &all {
            for (i, &id) in ids.iter().enumerate() {
                checksum = checksum.wrapping_add(u64::from(id).wrapping_mul(i as u64 + 1));
            }
        }
        println!(
            "{}",
            serde_json::json!({
                "pass": pass, "texts": texts.len(), "bytes": bytes, "tokens": tokens,
                "seconds": seconds, "checksum": checksum.to_string(),
            })
        );
    }
}
