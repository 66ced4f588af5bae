//! Memory bounded on any input: small files that decode to gigabytes (a `.jsonl.zst` of
//! 30 MiB lines, a Parquet file repeating one dictionary-encoded 1 MiB string, lines of
//! millions of tiny JSON values) are run by the real binary under an address-space limit
//! (`prlimit --as`) beside a plain dataset: the run never aborts, the plain dataset is
//! generated in full, each bomb's rows are rejected with their line or its intake stops
//! with a message naming the file and the limit, and the peak RSS stays under a bound.

use crate::process::{edit_config, Proc};
use crate::support::*;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The address-space limit the runs get: below what the bombs took before they were
/// bounded (3.7 and 5.4 GB resident), above what a run reserves without using (thread
/// stacks, the allocator's arenas of 1 GiB: up to ~2.1 GB).
const AS_LIMIT: u64 = 3 << 30;
/// The peak RSS a bomb run stays under.
const RSS_BOUND: u64 = 512 << 20;

/// 60 lines of `{"id": "z<i>", "prompt": "aaa…"}` 30 MiB long, zstd-compressed (~60 KB on disk).
pub(crate) fn write_zstd_bomb(path: &Path) {
    let mut enc =
        zstd::stream::write::Encoder::new(std::fs::File::create(path).unwrap(), 3).unwrap();
    let chunk = vec![b'a'; 1 << 20];
    for i in 0..60 {
        write!(enc, "{{\"id\": \"z{i}\", \"prompt\": \"").unwrap();
        for _ in 0..30 {
            enc.write_all(&chunk).unwrap();
        }
        enc.write_all(b"\"}\n").unwrap();
    }
    enc.finish().unwrap();
}

/// Column `prompt`: the same 1 MiB string in `rows` rows (each with its own `id`),
/// zstd-compressed, written by pyarrow. `dictionary`: the string once in a dictionary
/// page and the rows referring to it (~7 KB on disk for 3000 rows); otherwise plain
/// pages of up to 1024 values (one page of `rows` MiB, ~14 KB on disk).
pub(crate) fn write_parquet_bomb(path: &Path, rows: usize, dictionary: bool) {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
             rows, dictionary = int(sys.argv[2]), sys.argv[3] == '1'\n\
             col = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array(['x' * (1 << 20)]))\n\
             ids = pa.array([f'b{i}' for i in range(rows)])\n\
             pq.write_table(pa.table({'id': ids, 'prompt': col}), sys.argv[1], compression='zstd', use_dictionary=dictionary)\n",
        )
        .arg(path)
        .arg(rows.to_string())
        .arg(if dictionary { "1" } else { "0" })
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 8 lines of a prompt and `tools` holding 4 M empty objects (12 MB a line).
pub(crate) fn write_wide_json(path: &Path) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let objects = "{},".repeat(4 << 20);
    for i in 0..8 {
        writeln!(
            f,
            "{{\"id\": \"w{i}\", \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}], \"tools\": [{objects}{{}}]}}"
        )
        .unwrap();
    }
}

/// A config of dataset `plain` (20 prompts) and `bomb` (the file `bomb_file`), served by
/// the mock at `url`.
fn config(dir: &Path, url: &str, bomb_file: &str) -> PathBuf {
    write_prompts(&dir.join("plain.jsonl"), "p", 20);
    write_config(
        dir,
        url,
        "chat",
        false,
        &[
            Ds {
                name: "plain",
                file: "plain.jsonl",
                budget: None,
            },
            Ds {
                name: "bomb",
                file: bomb_file,
                budget: None,
            },
        ],
        "",
    )
}

/// Runs `spool run` under [`AS_LIMIT`]; returns (exit code, stderr, peak RSS).
async fn run_limited(cfg: &Path) -> (Option<i32>, String, u64) {
    let mut c = Command::new("prlimit");
    c.arg(format!("--as={AS_LIMIT}"))
        .arg(spool_bin())
        .args(["run", "-c"])
        .arg(cfg);
    let mut p = Proc::from_command(c);
    let (status, peak) = p.wait(Duration::from_secs(300)).await;
    eprintln!("peak RSS {} MiB", peak >> 20);
    (status.code(), p.stderr(), peak)
}

/// The plain dataset is generated in full whatever the bomb did.
fn assert_plain_done(dir: &Path) {
    let rows = shard_rows(&dir.join("out"), "plain");
    assert_eq!(rows.len(), 20, "the plain dataset is generated in full");
}

/// The rejected-rows file of dataset `bomb`, as JSON values.
fn rejected(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("out/bomb/_rejected.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A 60 KB `.jsonl.zst` of 60 lines of 30 MiB (1.8 GB decompressed): each line past the
/// row limit is rejected with its line without being held, and once the file has expanded
/// more than 1000× past 64 MiB its intake stops with a message naming the file and the
/// limit (exit 2); the plain dataset is done; peak RSS under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_bomb_is_refused_in_bounded_memory() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_zstd_bomb(&dir.path().join("bomb.jsonl.zst"));
    let cfg = config(dir.path(), &mock.url, "bomb.jsonl.zst");
    let (code, stderr, peak) = run_limited(&cfg).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("bomb.jsonl.zst") && stderr.contains("more than 1000× its compressed size"),
        "{stderr}"
    );
    assert!(stderr.contains("intake of bomb stopped"), "{stderr}");
    assert_plain_done(dir.path());
    let rej = rejected(dir.path());
    assert!(!rej.is_empty(), "the long lines are rejected");
    for (i, r) in rej.iter().enumerate() {
        assert_eq!(r["line"], i as u64 + 1);
        assert_eq!(r["reason"], "line longer than 16 MiB");
    }
    assert!(peak < RSS_BOUND, "peak RSS {} MiB", peak >> 20);
}

/// A 7 KB Parquet file of one dictionary-encoded 1 MiB string in 3000 rows (3 GB
/// decoded): read as views of its one dictionary page, its rows are taken in until they
/// have decoded to more than 1000× the file's size (past 64 MiB), where its intake stops
/// with a message naming the file and the limit (exit 2) — never an allocation abort; the
/// plain dataset is done; peak RSS under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_dictionary_bomb_is_refused_in_bounded_memory() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_parquet_bomb(&dir.path().join("bomb.parquet"), 3000, true);
    let cfg = config(dir.path(), &mock.url, "bomb.parquet");
    edit_config(&cfg, "max_tokens = 200", "max_tokens = 4");
    let (code, stderr, peak) = run_limited(&cfg).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("bomb.parquet") && stderr.contains("more than 1000× its size on disk"),
        "{stderr}"
    );
    assert_plain_done(dir.path());
    let taken = shard_rows(&dir.path().join("out"), "bomb").len();
    assert!(
        (60..=70).contains(&taken),
        "{taken} rows of the bomb generated"
    );
    assert!(peak < RSS_BOUND, "peak RSS {} MiB", peak >> 20);
}

/// The same string in 300 rows of plain pages: one page holds all 300 MiB (14 KB on
/// disk). Its header is read before anything is
/// decompressed and the page refused for being over 256 MiB: intake of the dataset stops
/// at once (exit 2), the plain dataset is done; peak RSS under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parquet_page_bomb_is_refused_before_decompression() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_parquet_bomb(&dir.path().join("bomb.parquet"), 300, false);
    let cfg = config(dir.path(), &mock.url, "bomb.parquet");
    let (code, stderr, peak) = run_limited(&cfg).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("bomb.parquet")
            && stderr.contains("row group 0, column `prompt`: a page of 300 MiB decompressed, over the 256 MiB limit"),
        "{stderr}"
    );
    assert_plain_done(dir.path());
    assert!(peak < RSS_BOUND, "peak RSS {} MiB", peak >> 20);
}

/// Lines of 4 M empty JSON objects (12 MB each, under the row's byte limit): each is
/// rejected with its line for holding more JSON values than a row may, while it is parsed;
/// the run goes on and the plain dataset is done; as every row of the wide file was
/// rejected, the run ends with exit 2 naming it; peak RSS under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wide_json_rows_are_rejected_in_bounded_memory() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_wide_json(&dir.path().join("wide.jsonl"));
    let cfg = config(dir.path(), &mock.url, "wide.jsonl");
    let (code, stderr, peak) = run_limited(&cfg).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("every row of the dataset was rejected"),
        "{stderr}"
    );
    assert_plain_done(dir.path());
    let rej = rejected(dir.path());
    assert_eq!(rej.len(), 8, "{rej:?}");
    for (i, r) in rej.iter().enumerate() {
        assert_eq!(r["line"], i as u64 + 1);
        assert_eq!(r["reason"], "row has more than 262144 JSON values");
    }
    assert!(peak < RSS_BOUND, "peak RSS {} MiB", peak >> 20);
}

/// Parquet rows whose cell decodes to 17 MiB (one dictionary string, 3 rows: 51 MiB in
/// all, under the file's expansion floor) are each rejected with their row for being over
/// the row limit, measured before the cell is copied; the row after them is taken in and
/// the run ends cleanly (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parquet_rows_over_the_row_limit_are_rejected_with_their_line() {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
             big = pa.DictionaryArray.from_arrays(pa.array([0, 0, 0, 1], pa.int32()), pa.array(['x' * (17 << 20), 'small prompt']))\n\
             ids = pa.array(['r0', 'r1', 'r2', 'r3'])\n\
             pq.write_table(pa.table({'id': ids, 'prompt': big}), sys.argv[1], compression='zstd')\n",
        )
        .arg(dir.path().join("big.parquet"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfg = config(dir.path(), &mock.url, "big.parquet");
    let (code, stderr, peak) = run_limited(&cfg).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_plain_done(dir.path());
    let rej = rejected(dir.path());
    let lines: Vec<u64> = rej.iter().map(|r| r["line"].as_u64().unwrap()).collect();
    assert_eq!(lines, [1, 2, 3], "{rej:?}");
    for r in &rej {
        assert_eq!(
            r["reason"],
            "row is over 16 MiB once decoded (the limit of a row)"
        );
    }
    let taken = shard_rows(&dir.path().join("out"), "bomb");
    assert_eq!(taken.len(), 1);
    assert!(peak < RSS_BOUND, "peak RSS {} MiB", peak >> 20);
}
