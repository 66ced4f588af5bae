//! `make bench-shard`: the crate's own [`ShardWriter`] writing zstd
//! Parquet shards of long completions with token-id lists, at zstd levels 1, 3 and 9.
//!
//! Rows are generated before the clock starts (seeded): a prompt of ~200 tokens, a
//! completion of log-normal length (mean ~3,500 tokens, σ = 1, capped at 10,240 — the mock
//! server's defaults), token ids drawn from a Zipf-like distribution over a 151k vocabulary
//! and the text made of the words those ids stand for, so text and ids compress like real
//! output. Timed: `append` of every row plus `finish` (close, fsync, rename, dir fsync).
//! Raw bytes = the strings plus 4 bytes per token id (what the rows hold in memory);
//! MB/s = raw MB / s; ratio = raw bytes / file bytes.
//!
//! usage: cargo run --release --example bench_shard -- [ROWS] [LEVELS] [OUT_DIR]
//!        (defaults: 2000 rows, levels 1,3,9, a temporary folder)
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use spool::output::shard::ShardLimits;
use spool::output::writer::ShardWriter;
use spool::store::row::ShardRow;
use std::time::Instant;

const VOCAB: u32 = 151_669;

/// A word per token id (deterministic, 2–9 letters, a leading space most of the time).
fn word(id: u32) -> String {
    let mut h = id.wrapping_mul(2_654_435_761);
    let len = 2 + (h % 8) as usize;
    let mut s = String::with_capacity(len + 1);
    if !h.is_multiple_of(5) {
        s.push(' ');
    }
    for _ in 0..len {
        h = h.rotate_left(5) ^ 0x9e37_79b9;
        s.push((b'a' + (h % 26) as u8) as char);
    }
    s
}

/// Token ids with a heavy head (Zipf-like: id ~ VOCAB^u, u uniform), and their text.
fn tokens(rng: &mut SmallRng, words: &[String], n: usize) -> (Vec<u32>, String) {
    let mut ids = Vec::with_capacity(n);
    let mut text = String::with_capacity(n * 6);
    for _ in 0..n {
        let u: f64 = rng.random();
        let id = ((VOCAB as f64).powf(u) as u32).min(VOCAB - 1);
        ids.push(id);
        text.push_str(&words[id as usize]);
    }
    (ids, text)
}

fn rows(n: usize) -> Vec<ShardRow> {
    let mut rng = SmallRng::seed_from_u64(5);
    let words: Vec<String> = (0..VOCAB).map(word).collect();
    // Mean of LogNormal(mu, 1) is exp(mu + 1/2): mean 3,500 tokens.
    let len = LogNormal::new(3500f64.ln() - 0.5, 1.0).expect("valid log-normal");
    (0..n)
        .map(|i| {
            let (pids, prompt) = tokens(&mut rng, &words, 150 + (i % 100));
            let c = (len.sample(&mut rng) as usize).clamp(1, 10_240);
            let (cids, completion) = tokens(&mut rng, &words, c);
            ShardRow {
                id: format!("{i:016x}"),
                dataset: "bench".into(),
                row: i as u64,
                prompt,
                messages: None,
                prompt_tokens: pids.len() as u32,
                prompt_token_ids: Some(pids),
                completion,
                completion_tokens: c as u32,
                completion_token_ids: Some(cids),
                finish_reason: if c == 10_240 { "length" } else { "stop" }.into(),
                model: "bench-model".into(),
                attempts: 1,
                latency_ms: 1000 + (i as u32 % 5000),
                ttft_ms: Some(50),
                completed_at_ms: 1_764_633_600_000 + i as i64,
                sample: 0,
                turn: 0,
                reasoning: None,
                tool_calls: None,
                tools: None,
                sampling: None,
                partial: None,
                prompt_ids_source: Some(spool::prompt::remote::IdsSource::Client),
            }
        })
        .collect()
}

fn raw_bytes(r: &ShardRow) -> usize {
    r.id.len()
        + r.dataset.len()
        + r.prompt.len()
        + r.completion.len()
        + r.finish_reason.len()
        + r.model.len()
        + 4 * (r.prompt_token_ids.as_ref().map_or(0, Vec::len)
            + r.completion_token_ids.as_ref().map_or(0, Vec::len))
        + 8
        + 4 * 5
        + 8
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map_or(Ok(2000), |s| s.parse())?;
    let levels: Vec<i32> = args
        .get(1)
        .map_or("1,3,9", String::as_str)
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let tmp = tempfile::tempdir()?;
    let out = args
        .get(2)
        .map_or_else(|| tmp.path().to_path_buf(), std::path::PathBuf::from);
    let data = rows(n);
    let raw: usize = data.iter().map(raw_bytes).sum();
    let tokens: u64 = data
        .iter()
        .map(|r| u64::from(r.completion_tokens + r.prompt_tokens))
        .sum();
    println!(
        "{n} rows, {:.1} MB raw, {:.0} tokens/row (prompt + completion), batches of 64 rows",
        raw as f64 / 1e6,
        tokens as f64 / n as f64
    );
    println!("| zstd level | rows/s | MB/s (raw) | tokens/s | file MB | ratio | seconds |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (i, level) in levels.iter().enumerate() {
        let limits = ShardLimits {
            max_rows: n,
            max_bytes: u64::MAX,
            compression_level: *level,
        };
        let dir = out.join(format!("level-{level}"));
        let t = Instant::now();
        let mut w = ShardWriter::create(
            &dir,
            i as u64,
            &limits,
            vec![],
            &spool::knobs::Faults::default(),
        )?;
        for chunk in data.chunks(64) {
            w.append(chunk)?;
        }
        let sealed = w.finish()?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "| {level} | {:.0} | {:.1} | {:.0} | {:.1} | {:.2} | {:.2} |",
            n as f64 / s,
            raw as f64 / 1e6 / s,
            tokens as f64 / s,
            sealed.bytes as f64 / 1e6,
            raw as f64 / sealed.bytes as f64,
            s
        );
    }
    Ok(())
}
