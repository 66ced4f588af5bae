//! `spool verify` against real runs: a clean run verifies clean, and each kind of damage to
//! the output (deleted, duplicated, truncated or rewritten shards, stray files) is found and
//! named, in the library and through the real binary's exit code and output.

use crate::support::*;
use spool::output::reader;
use spool::output::shard::{self, ShardLimits};
use spool::output::verify::{verify, Problem, VerifyReport};
use spool::output::writer::ShardWriter;
use spool::store::queue::Queue;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPTS: usize = 60;

/// A finished run of `PROMPTS` prompts (max_rows 25: shards of 25, 25 and 10 rows) in a
/// temp dir; returns the dir and the config path.
async fn finished_run() -> (tempfile::TempDir, PathBuf) {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    write_prompts(&dir.path().join("p.jsonl"), "p", PROMPTS);
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
    let summary = run_to_end(&cfg).await;
    assert_eq!(summary.report.failed(), 0);
    mock.stop().await;
    assert_eq!(shard_files(&dir.path().join("out"), "a").len(), 3);
    (dir, cfg)
}

fn check(cfg: &Path) -> VerifyReport {
    let cfg = load(cfg);
    let queue = Queue::open(&cfg.data_dir).unwrap();
    verify(&queue, &cfg).unwrap()
}

fn shard(dir: &tempfile::TempDir, index: u64) -> PathBuf {
    dir.path().join("out/a").join(shard::shard_file_name(index))
}

fn lines(r: &VerifyReport) -> String {
    r.problems
        .iter()
        .map(|p| format!("{p}\n"))
        .collect::<String>()
}

/// A clean run verifies clean: no problems, every prompt's row read, nothing waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_run_verifies_clean() {
    let (dir, cfg) = finished_run().await;
    let r = check(&cfg);
    assert!(r.is_clean(), "{}", lines(&r));
    assert_eq!(r.rows, PROMPTS as u64);
    assert_eq!(r.shards, 3);
    assert_eq!(r.waiting_for_shard, 0);
    assert_eq!(r.datasets.len(), 1);
    assert_eq!(r.datasets[0].done, PROMPTS as u64);
    drop(dir);
}

/// Deleting a shard is found: every one of its rows is reported as done but in no shard
/// (with its id), and the missing file is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_shard_leaves_done_items_in_no_shard() {
    let (dir, cfg) = finished_run().await;
    let victim = shard(&dir, 1);
    let keys: BTreeSet<(u64, String)> = reader::read_keys(&victim)
        .unwrap()
        .into_iter()
        .map(|(id, row)| (row, id))
        .collect();
    assert_eq!(keys.len(), 25);
    std::fs::remove_file(&victim).unwrap();

    let r = check(&cfg);
    let mut missing = BTreeSet::new();
    for p in &r.problems {
        match p {
            Problem::DoneButInNoShard {
                row, id, recorded, ..
            } => {
                assert_eq!(recorded, &victim);
                missing.insert((*row, id.clone()));
            }
            Problem::MissingShard { path, rows } => {
                assert_eq!((path, *rows), (&victim, 25));
            }
            other => panic!("unexpected problem: {other}"),
        }
    }
    assert_eq!(missing, keys, "{}", lines(&r));
    assert!(r
        .problems
        .iter()
        .any(|p| matches!(p, Problem::MissingShard { .. })));
    assert_eq!(r.rows, (PROMPTS - 25) as u64);
}

/// A shard copied under a new index (its rows now twice on disk) is found: each row is a
/// duplicate naming both files, and the copy is an unrecorded shard `spool run` would not
/// adopt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_shard_is_reported_as_duplicates() {
    let (dir, cfg) = finished_run().await;
    let copy = shard(&dir, 9);
    std::fs::copy(shard(&dir, 0), &copy).unwrap();

    let r = check(&cfg);
    let dups: Vec<&Problem> = r
        .problems
        .iter()
        .filter(|p| matches!(p, Problem::Duplicate { .. }))
        .collect();
    assert_eq!(dups.len(), 25, "{}", lines(&r));
    for d in &dups {
        let Problem::Duplicate { places, .. } = d else {
            unreachable!()
        };
        assert_eq!(places, &vec![shard(&dir, 0), copy.clone()]);
    }
    assert!(
        r.problems.iter().any(|p| matches!(
            p,
            Problem::UnrecordedShard { path, adoptable: false, .. } if path == &copy
        )),
        "{}",
        lines(&r)
    );
    assert!(lines(&r).contains("part-000009.parquet"));
}

/// A truncated shard (a partial file under a final name) is unreadable, and its rows are
/// then in no readable shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_shard_is_unreadable() {
    let (dir, cfg) = finished_run().await;
    let victim = shard(&dir, 2);
    let len = std::fs::metadata(&victim).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&victim)
        .unwrap();
    f.set_len(len / 2).unwrap();
    drop(f);

    let r = check(&cfg);
    assert!(
        r.problems
            .iter()
            .any(|p| matches!(p, Problem::UnreadableShard { path, .. } if path == &victim)),
        "{}",
        lines(&r)
    );
    let lost = r
        .problems
        .iter()
        .filter(|p| matches!(p, Problem::DoneButInNoShard { .. }))
        .count();
    assert_eq!(lost, 10, "{}", lines(&r));
    assert!(!r
        .problems
        .iter()
        .any(|p| matches!(p, Problem::MissingShard { .. })));
}

/// A writer's leftover temporary file and any unrelated file in a dataset folder are stray
/// files; `_rejected.jsonl` is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_and_temporary_files_are_reported() {
    let (dir, cfg) = finished_run().await;
    let folder = dir.path().join("out/a");
    let tmp = folder.join(".part-000009.parquet.tmp");
    let notes = folder.join("notes.txt");
    std::fs::write(&tmp, b"partial").unwrap();
    std::fs::write(&notes, b"hello").unwrap();
    std::fs::write(folder.join("_rejected.jsonl"), b"").unwrap();

    let r = check(&cfg);
    assert_eq!(
        r.problems,
        vec![
            Problem::StrayFile { path: tmp },
            Problem::StrayFile { path: notes }
        ],
        "{}",
        lines(&r)
    );
    assert!(lines(&r).contains("temporary file"));
}

/// A row whose completion_token_ids length differs from completion_tokens is named (file,
/// row, id, both numbers), and nothing else is reported for the rewritten shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_count_mismatch_is_found() {
    let (dir, cfg) = finished_run().await;
    let victim = shard(&dir, 0);
    let mut rows = reader::read_rows(&victim).unwrap();
    let meta = reader::read_metadata(&victim).unwrap();
    let bad = &mut rows[3];
    let n = bad.completion_tokens as usize;
    bad.completion_token_ids = Some(vec![1; n + 2]);
    let (bad_row, bad_id) = (bad.row, bad.id.clone());
    std::fs::remove_file(&victim).unwrap();
    let mut w = ShardWriter::create(
        &dir.path().join("out/a"),
        0,
        &ShardLimits::default(),
        meta,
        &spool::knobs::Faults::default(),
    )
    .unwrap();
    w.append(&rows).unwrap();
    w.finish().unwrap();

    let r = check(&cfg);
    assert_eq!(
        r.problems,
        vec![Problem::TokenCountMismatch {
            path: victim,
            row: bad_row,
            id: bad_id,
            completion_tokens: n as u32,
            ids_len: n + 2,
        }],
        "{}",
        lines(&r)
    );
}

fn spool_verify(cfg: &Path) -> std::process::Output {
    Command::new(spool_bin())
        .args(["verify", "-q", "-c"])
        .arg(cfg)
        .output()
        .unwrap()
}

/// The binary: exit 0 on a clean output, exit 1 after damage with the damaged file named on
/// stdout, and exit 2 with a clear message while another process holds the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_exits_by_outcome_and_names_the_damage() {
    let (dir, cfg) = finished_run().await;
    let out = spool_verify(&cfg);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("60 row(s) checked"), "{stdout}");
    assert!(stdout.contains("verify: clean"), "{stdout}");

    let victim = shard(&dir, 1);
    let len = std::fs::metadata(&victim).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&victim)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let out = spool_verify(&cfg);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("part-000001.parquet"), "{stdout}");
    assert!(stdout.contains("unreadable shard"), "{stdout}");

    let held = Queue::open(&dir.path().join("data")).unwrap();
    let out = spool_verify(&cfg);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("spool run` is active"), "{stderr}");
    drop(held);
}

/// Shards written before the generation columns existed (`tests/fixtures/shard-v1`,
/// written by the build of `2f50701`, with its format-4 queue) still read: `verify` finds
/// them clean (opening the queue migrates it to the current format), `export` writes their
/// four rows with sample and turn 0 and no `reasoning_content`, and `show` prints them with
/// the new fields at their defaults.
#[test]
fn shards_written_before_the_generation_columns_verify_export_and_show() {
    let tmp = tempfile::tempdir().unwrap();
    let job = tmp.path().join("fixtures/shard-v1");
    std::fs::create_dir_all(tmp.path().join("fixtures")).unwrap();
    let cp = Command::new("cp")
        .arg("-r")
        .arg(fixtures().join("shard-v1"))
        .arg(&job)
        .status()
        .unwrap();
    assert!(cp.success());
    std::os::unix::fs::symlink(
        fixtures().join("tokenizers"),
        tmp.path().join("fixtures/tokenizers"),
    )
    .unwrap();
    let cfg = job.join("spool.toml");
    let out = spool_verify(&cfg);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 row(s)"), "{stdout}");
    let q = Queue::open(&job.join("data")).unwrap();
    let s = q.state(0).unwrap();
    assert_eq!((s.items, s.done, s.sharded, s.next_shard), (4, 4, 4, 2));
    assert_eq!(q.item(0, 1).unwrap().unwrap().extra, None);
    drop(q);

    let jsonl = tmp.path().join("x.jsonl");
    let st = Command::new(spool_bin())
        .args(["export", "-q", "--format", "sharegpt", "-c"])
        .arg(&cfg)
        .arg("--out")
        .arg(&jsonl)
        .status()
        .unwrap();
    assert!(st.success());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4);
    for l in &lines {
        assert_eq!(
            (l["sample"].as_u64(), l["turn"].as_u64()),
            (Some(0), Some(0))
        );
        let last = l["conversations"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(last["role"], "assistant");
        assert!(last.get("reasoning_content").is_none(), "{l}");
    }

    let shown = Command::new(spool_bin())
        .args(["show", "-n", "2"])
        .arg(job.join("out/chat/part-000000.parquet"))
        .output()
        .unwrap();
    assert!(shown.status.success());
    let text = String::from_utf8_lossy(&shown.stdout);
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for r in rows {
        assert_eq!(
            (r["sample"].as_u64(), r["turn"].as_u64()),
            (Some(0), Some(0))
        );
        assert!(r["reasoning"].is_null() && r["partial"].is_null(), "{r}");
        assert!(!r["completion"].as_str().unwrap().is_empty());
    }
}
