//! Kimi K2.5's tool declarations against Moonshot's own code: every case of
//! `tests/fixtures/moonshot/encoder-cases.jsonl` goes through the vendored
//! `tool_declaration_ts.py` (tests/python/kimi_tools.py, the oracle) and through
//! `spool::prompt::kimi_tools`; the TypeScript text is the same, and where the Python code
//! raises (so `tokenization_kimi.py` falls back to JSON declarations), spool's encoder fails
//! too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use spool::prompt::kimi_tools::encode_tools_to_typescript_style;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// The oracle's answer for each case: `Ok(typescript)` or `Err(python exception)`.
fn run_oracle(cases: &Path) -> BTreeMap<String, Result<String, String>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/kimi_tools.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(cases)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "kimi_tools.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("oracle output is UTF-8")
        .lines()
        .map(|line| {
            let record: Value = serde_json::from_str(line).expect("oracle line is JSON");
            let id = record["id"].as_str().unwrap().to_owned();
            let answer = match (&record["typescript"], &record["error"]) {
                (Value::String(ts), _) => Ok(ts.clone()),
                (_, Value::String(error)) => Err(error.clone()),
                _ => panic!("oracle line without an answer: {line}"),
            };
            (id, answer)
        })
        .collect()
}

/// Every case: spool's declarations equal Moonshot's byte for byte, and spool's encoder
/// fails exactly where Moonshot's raises. Both outcomes are exercised.
#[test]
fn kimi_tool_declarations_match_moonshots_encoder() {
    let cases_path = fixture("moonshot/encoder-cases.jsonl");
    let cases: Vec<Value> = std::fs::read_to_string(&cases_path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("case line is JSON"))
        .collect();
    let oracle = run_oracle(&cases_path);
    assert_eq!(oracle.len(), cases.len());

    let (mut declared, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for case in &cases {
        let id = case["id"].as_str().unwrap();
        let ours = encode_tools_to_typescript_style(&case["tools"]);
        match (&oracle[id], ours) {
            (Ok(want), Ok(got)) if &got == want => declared += 1,
            (Ok(want), Ok(got)) => failures.push(format!(
                "{id}: differs\n  spool: {got:?}\n   want: {want:?}"
            )),
            (Ok(_), Err(e)) => failures.push(format!("{id}: Moonshot's code declares, spool: {e}")),
            (Err(python), Ok(got)) => failures.push(format!(
                "{id}: Moonshot's code raises {python}, spool: {got:?}"
            )),
            (Err(_), Err(_)) => refused += 1,
        }
    }
    println!(
        "kimi tool declarations: {declared} declared, {refused} refused (JSON fallback), of {}",
        cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        declared >= 30 && refused >= 15,
        "{declared} declared, {refused} refused"
    );
}
