//! `make demo` is part of the contract: the script itself runs here, against this build.

use crate::support::spool_bin;
use std::process::Command;

/// `scripts/demo.sh` (what `make demo` runs) starts the mock server on a free loopback
/// port, runs the example config to completion, prints the resume lines, the status table
/// with the budget-bound dataset, a clean verify and the first rows of a shard, stops the
/// mock server, and exits 0; its second run requests nothing.
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
    // Resume lines (SPEC §4.1) on the first run.
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
        .filter(|l| l.starts_with("chat ") || l.starts_with("code ") || l.starts_with("math "))
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
    assert!(stdout.contains("verify: clean"), "{stdout}");
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
