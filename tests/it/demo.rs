//! `make demo` is part of the contract: the script itself runs here, against this build,
//! and also as a newcomer with a shared cargo target folder runs it.

use crate::support::spool_bin;
use std::path::Path;
use std::process::Command;

/// `scripts/demo.sh` (what `make demo` runs) starts the mock server on a free loopback
/// port, runs the example config to completion, prints the resume lines, the status table
/// with the budget-bound dataset, a clean verify and the first rows of a shard, stops the
/// mock server, and exits 0; its second run requests nothing. It runs `concurrency = "auto"`.
#[test]
fn make_demo_runs_end_to_end() {
    let out = tempfile::tempdir().unwrap();
    let demo_out = out.path().join("demo");
    let o = Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/demo.sh"))
        .env("SPOOL_BIN", spool_bin())
        .env("DEMO_OUT", &demo_out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "demo failed: {:?}\n{stdout}\n{stderr}",
        o.status
    );
    // The resume lines of the first run.
    assert!(
        stderr.contains("chat: 120 prompts (0 done, 0 tokens; 120 to go; no budget)"),
        "{stderr}"
    );
    assert!(
        stderr.contains("math: 80 prompts (0 done, 0 tokens; 80 to go; budget left 12,000)"),
        "{stderr}"
    );
    // The status table: chat and code done, math stopped by its budget.
    let table: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            ["chat ", "code ", "math ", "dialogues "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect();
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("chat") && l.contains("120/120") && l.ends_with("done")),
        "{stdout}"
    );
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("math") && l.ends_with("budget_met")),
        "{stdout}"
    );
    // The multi-turn reasoning dataset: every conversation regenerated (2 samples × 3
    // turns each), thinking split into its own column.
    assert!(
        table
            .iter()
            .any(|l| l.starts_with("dialogues") && l.contains("20/20") && l.ends_with("done")),
        "{stdout}"
    );
    assert!(
        stdout.contains("\"dataset\":\"dialogues\"")
            && stdout.contains("\"turn\":2")
            && stdout.contains("\"reasoning\":\""),
        "{stdout}"
    );
    assert!(stdout.contains("verify: clean"), "{stdout}");
    // The mock answers in the [tokenizer]'s real tokens: the self-check finds its ids
    // decode to its text, and so do the rows' ids (what the id exports carry).
    assert!(stderr.contains("self-check: "), "{stderr}");
    // The example runs with `concurrency = "auto"`: the server's own limit, found by the run.
    let limit: usize = stderr
        .lines()
        .find(|l| l.contains("concurrency limit at the end"))
        .and_then(|l| l.split("limit=").nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no closing limit line: {stderr}"));
    assert!(limit >= 1, "{stderr}");
    assert!(!stderr.contains("do not decode to its text"), "{stderr}");
    let tok = spool::prompt::tokenizer::Tokenizer::from_file(
        &crate::support::fixtures().join("tokenizers/qwen3/tokenizer.json"),
    )
    .unwrap();
    let rows = crate::support::shard_rows(&demo_out.join("spool-out"), "dialogues");
    assert!(rows.iter().any(|r| !r.completion.trim().is_empty()));
    for r in &rows {
        let text = tok
            .decode(r.completion_token_ids.as_ref().unwrap())
            .unwrap();
        for part in [
            r.completion.trim(),
            r.reasoning.as_deref().unwrap_or("").trim(),
        ] {
            assert!(text.contains(part), "{part:?} not in {text:?}");
        }
    }
    assert!(
        stdout.contains("\"dataset\":\"chat\"") && stdout.contains("rows in"),
        "{stdout}"
    );
    // The second run found nothing to do: the table is printed twice, identical.
    let firsts: Vec<&&str> = table.iter().filter(|l| l.starts_with("math")).collect();
    assert_eq!(firsts.len(), 2);
    assert_eq!(firsts[0], firsts[1]);
    // The mock server was stopped: its port no longer answers.
    let addr = std::fs::read_to_string(demo_out.join("mock.addr")).unwrap();
    let hostport = addr
        .trim()
        .trim_start_matches("listening on http://")
        .to_string();
    assert!(
        std::net::TcpStream::connect(hostport).is_err(),
        "mock server still running"
    );
}

/// With `CARGO_TARGET_DIR` set (a target folder outside the repository), `scripts/demo.sh`
/// runs the binary where cargo reports it, not `target/debug/spool`: run from a copy of
/// the repository that has no `target/` of its own, the demo reaches a clean verify.
///
/// `cargo` here is a stand-in on `PATH` that answers as a fresh build does (its JSON
/// messages, the binary under `$CARGO_TARGET_DIR/debug/`, which links to this build), so
/// nothing is compiled and this suite's own binary is never replaced under the tests
/// running it. A script that assumed `target/debug/spool` fails here.
#[test]
fn make_demo_finds_the_binary_through_cargo_target_dir() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("spool");
    std::fs::create_dir(&copy).unwrap();
    // The repository's files as links, everything but a target folder.
    for entry in std::fs::read_dir(repo).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == "target" || name == "demo-out" {
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), copy.join(&name)).unwrap();
    }
    // The shared target folder: this build's binary where cargo would put it.
    let target = tmp.path().join("shared-target");
    std::fs::create_dir_all(target.join("debug")).unwrap();
    std::os::unix::fs::symlink(spool_bin(), target.join("debug/spool")).unwrap();
    let bin_dir = tmp.path().join("bin");
    std::fs::create_dir(&bin_dir).unwrap();
    let calls = tmp.path().join("cargo-calls");
    let cargo = bin_dir.join("cargo");
    std::fs::write(
        &cargo,
        format!(
            r#"#!/usr/bin/env bash
# cargo for a build that is already fresh: `cargo build` only, as cargo answers it.
echo "$*" >>'{calls}'
[[ "$1" == build ]] || {{ echo "stand-in cargo: only build, not: $*" >&2; exit 101; }}
[[ "$PWD" == '{copy}' ]] || {{ echo "stand-in cargo: run in $PWD" >&2; exit 101; }}
T=${{CARGO_TARGET_DIR:?stand-in cargo: CARGO_TARGET_DIR unset}}
case " $* " in
  *" --message-format=json"*)
    M='"manifest_path":"{copy}/Cargo.toml"'
    echo '{{"reason":"compiler-artifact","package_id":"path+file://{copy}#spool@0.1.0",'"$M"',"target":{{"kind":["lib"],"crate_types":["lib"],"name":"spool","src_path":"{copy}/src/lib.rs","edition":"2021","doc":true,"doctest":true,"test":true}},"features":[],"filenames":["'"$T"'/debug/libspool.rlib"],"executable":null,"fresh":true}}'
    echo '{{"reason":"compiler-artifact","package_id":"path+file://{copy}#spool@0.1.0",'"$M"',"target":{{"kind":["bin"],"crate_types":["bin"],"name":"spool","src_path":"{copy}/src/main.rs","edition":"2021","doc":true,"doctest":false,"test":true}},"features":[],"filenames":["'"$T"'/debug/spool"],"executable":"'"$T"'/debug/spool","fresh":true}}'
    echo '{{"reason":"build-finished","success":true}}'
    ;;
esac
"#,
            calls = calls.display(),
            copy = copy.display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("bash")
        .arg(copy.join("scripts/demo.sh"))
        .current_dir(&copy)
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", &target)
        .env("DEMO_OUT", tmp.path().join("demo"))
        .env_remove("SPOOL_BIN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "demo with CARGO_TARGET_DIR failed: {:?}\n{stdout}\n{stderr}",
        o.status
    );
    assert!(stdout.contains("verify: clean"), "{stdout}");
    // The demo built through cargo, and wrote nothing under ./target.
    let calls = std::fs::read_to_string(&calls).unwrap();
    assert!(calls.lines().any(|l| l.starts_with("build")), "{calls}");
    assert!(!copy.join("target").exists(), "the demo wrote ./target");
}
