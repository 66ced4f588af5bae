//! What a newcomer meets in the first hour, through the real binary: a usage error exits 2
//! in every command and says what to do; a dataset whose every row is rejected ends the
//! run with exit 2 naming the key to add (and reads `rejected`, never `pending`); commands
//! that report on stdout keep INFO lines out of the way, and an export's flags the user
//! must change exit 2; the mock says at start what it will answer like.

use crate::process::{spool, status_json};
use crate::support::*;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every command refuses an unknown flag, a missing argument or a bad value with exit 2
/// and its own usage line; a missing config, a shard that is not there and a bad mock
/// address are the user's to fix too (exit 2, naming what to change).
#[test]
fn usage_errors_exit_2_in_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        Command::new(spool_bin())
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap()
    };
    for cmd in [
        "run",
        "status",
        "verify",
        "finalize",
        "retry",
        "show",
        "export",
        "mock-server",
    ] {
        let o = run(&[cmd, "--no-such-flag"]);
        assert_eq!(o.status.code(), Some(2), "{cmd}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("Usage: spool {cmd}")),
            "{cmd}: {}",
            stderr(&o)
        );
    }
    for args in [
        &["export", "--out", "x.jsonl"][..],
        &["export", "--format", "nope", "--out", "x"],
        &["show"],
        &["mock-server", "--time-scale", "fast"],
        &["frobnicate"],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    for (args, says) in [
        (&["status", "-c", "missing.toml"][..], "missing.toml"),
        (&["run", "-c", "missing.toml"], "missing.toml"),
        (&["show", "nope.parquet"], "is not a file"),
        (
            &["mock-server", "--addr", "256.0.0.1:1"],
            "`--addr 127.0.0.1:0` picks a free port",
        ),
        (&["status", "--url", "127.0.0.1:9"], "add `http://`"),
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{args:?}: {}", stderr(&o));
    }
}

/// A dataset of chat rows with no chat template (raw completions API): every row is
/// rejected for that one reason. The other dataset runs to the end; the run exits 2 and
/// names the key to set; `status` shows `rejected`, not `pending`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_rejected_whole_exits_2_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    write_prompts(&dir.path().join("p.jsonl"), "p", 5);
    write_chats(&dir.path().join("c.jsonl"), "c", 4);
    let cfg = write_config(
        dir.path(),
        &mock.url,
        "completions",
        false,
        &[
            Ds {
                name: "plain",
                file: "p.jsonl",
                budget: None,
            },
            Ds {
                name: "chats",
                file: "c.jsonl",
                budget: None,
            },
        ],
        "",
    );
    let o = spool(&cfg, &["run"], &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("every row of the dataset was rejected"),
        "{err}"
    );
    assert!(err.contains("`[tokenizer] chat_template`"), "{err}");
    assert!(err.contains("chats"), "{err}");
    let st = status_json(&cfg);
    let state = |name: &str| {
        st["datasets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {st}"))["state"]
            .clone()
    };
    assert_eq!(state("plain"), "done", "{st}");
    assert_eq!(state("chats"), "rejected", "{st}");
    let table = spool(&cfg, &["status"], &[]);
    let table = String::from_utf8_lossy(&table.stdout);
    let line = table.lines().find(|l| l.starts_with("chats")).unwrap();
    assert!(line.ends_with("rejected"), "{table}");
}

/// After a run, `status`, `verify`, `show` and `export` print their answer without the
/// queue's INFO lines on stderr; `-v` brings the detail back. An export the user must
/// change (an unknown `--dataset`, a `--holdout` that is no fraction, an id export of rows
/// without ids, `--end-of-turn` by name without a tokenizer) exits 2 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reporting_commands_keep_info_lines_out_of_the_way() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    write_prompts(&dir.path().join("p.jsonl"), "p", 3);
    let cfg = one_dataset(dir.path(), &mock.url);
    let o = spool(&cfg, &["run"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains(" INFO "), "run keeps its INFO lines");
    let shard = shard_files(&dir.path().join("out"), "a")
        .into_iter()
        .next()
        .expect("a shard");
    let out = dir.path().join("e.jsonl");
    let commands: Vec<Vec<String>> = vec![
        vec!["status".into()],
        vec!["verify".into()],
        vec!["show".into(), shard.display().to_string()],
        vec![
            "export".into(),
            "--format".into(),
            "sharegpt".into(),
            "--out".into(),
            out.display().to_string(),
        ],
    ];
    for args in &commands {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // `show` reads a shard, not a config: it takes no `-c`.
        let o = if args[0] == "show" {
            Command::new(spool_bin())
                .args(&args)
                .env("RUST_LOG", "")
                .output()
                .unwrap()
        } else {
            spool(&cfg, &args, &[("RUST_LOG", "")])
        };
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        assert!(!o.stdout.is_empty(), "{args:?} answers on stdout");
        assert!(!stderr(&o).contains(" INFO "), "{args:?}: {}", stderr(&o));
    }
    let o = spool(&cfg, &["status", "-v"], &[]);
    assert!(
        stderr(&o).contains("queue opened"),
        "-v shows the detail: {}",
        stderr(&o)
    );
    // What an export needs from the user is theirs to change: exit 2, naming it.
    let out = out.display().to_string();
    for (args, says) in [
        (&["--dataset", "nope"][..], "--dataset"),
        (&["--holdout", "2"], "--holdout 2"),
        (&["--format", "specforge"], "token ids"),
        (&["--end-of-turn", "<|im_end|>"], "--end-of-turn"),
    ] {
        let mut all = vec!["export", "--force", "--out", &out];
        all.extend_from_slice(args);
        if !args.contains(&"--format") {
            all.extend_from_slice(&["--format", "sharegpt"]);
        }
        let o = spool(&cfg, &all, &[]);
        assert_eq!(o.status.code(), Some(2), "{all:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(says), "{all:?}: {}", stderr(&o));
    }
}

/// `spool mock-server` says at start what it answers like (its ids, its speed, the
/// flags that change them) before its address line, and by default a mean answer takes
/// seconds, not a minute.
#[test]
fn the_mock_says_what_it_answers_like() {
    let mut child = Command::new(spool_bin())
        .args(["mock-server", "--addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(
        first.starts_with("listening on http://127.0.0.1:"),
        "{first}"
    );
    child.kill().unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(
        err.contains("spool mock-server: model \"mock-model\""),
        "{err}"
    );
    assert!(err.contains("tok/s a request"), "{err}");
    assert!(err.contains("--tokenizer"), "{err}");
    assert!(err.contains("Ctrl-C stops it"), "{err}");
    let secs: f64 = err
        .split("takes ~")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no time per answer in {err}"));
    assert!(secs <= 10.0, "a mean answer takes {secs} s by default");
}

/// Each command's `--help` lists the flags it takes and no other: `run` has the overrides
/// of a run, `show` and `mock-server` none of the config's, `verify` no run knobs.
#[test]
fn each_commands_help_lists_only_what_applies() {
    let help = |cmd: &str| {
        let o = Command::new(spool_bin())
            .args([cmd, "--help"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{cmd}");
        String::from_utf8(o.stdout).unwrap()
    };
    let takes = |cmd: &str, yes: &[&str], no: &[&str]| {
        let h = help(cmd);
        for f in yes {
            assert!(h.contains(f), "{cmd} --help lacks {f}:\n{h}");
        }
        for f in no {
            assert!(!h.contains(f), "{cmd} --help lists {f}:\n{h}");
        }
    };
    let run_only = ["--concurrency", "--partition <I>"];
    takes(
        "run",
        &[
            "--config",
            "--data-dir",
            "--concurrency",
            "--metrics-addr",
            "--partitions",
            "--partition <I>",
        ],
        &["--format", "--capacity-tps"],
    );
    takes(
        "status",
        &["--config", "--url", "--json", "--metrics-addr"],
        &run_only,
    );
    takes(
        "verify",
        &["--config", "--partitions"],
        &["--concurrency", "--partition <I>", "--metrics-addr"],
    );
    takes(
        "export",
        &["--config", "--format", "--out"],
        &["--concurrency", "--metrics-addr"],
    );
    takes("finalize", &["--config", "--partial"], &run_only);
    takes(
        "show",
        &["<SHARD>", "--rows"],
        &["--config", "--data-dir", "--concurrency"],
    );
    takes(
        "mock-server",
        &["--addr", "--tokenizer"],
        &["--config", "--data-dir", "--concurrency", "--partitions"],
    );
}
