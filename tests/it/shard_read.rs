//! Shards as other tools see them: a shard written by the library is read back by
//! `tests/read_shard.py` with pyarrow (and DuckDB when importable), which checks the schema
//! against `schemas/shard.schema.json`, the codec and the metadata, then prints the rows as
//! JSON for comparison with what was written. Without pyarrow the test fails; without
//! DuckDB it fails only when `SPOOL_TEST_REQUIRE_DUCKDB` is set.

use std::path::Path;
use std::process::Command;

use spool::output::schema;
use spool::output::shard::ShardLimits;
use spool::output::writer::ShardWriter;
use spool::store::row::ShardRow;

fn rows() -> Vec<ShardRow> {
    vec![
        ShardRow {
            id: "chat:0".into(),
            dataset: "chat".into(),
            row: 0,
            prompt: "<|user|>héllo — 日本語 🚀\n<|assistant|>".into(),
            messages: Some(r#"[{"role":"user","content":"héllo — 日本語 🚀"}]"#.into()),
            prompt_token_ids: Some(vec![1, 2, 3, u32::MAX]),
            completion: "Bonjour \"monde\"\t✓".into(),
            completion_token_ids: Some(vec![42, 0, 7]),
            prompt_tokens: 4,
            completion_tokens: 3,
            finish_reason: "stop".into(),
            model: "test-model".into(),
            attempts: 1,
            latency_ms: 1234,
            ttft_ms: Some(56),
            completed_at_ms: 1_767_225_600_123,
            sample: 2,
            turn: u32::MAX,
            reasoning: Some("Let me think — 日本語".into()),
            tool_calls: Some(
                r#"[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]"#
                    .into(),
            ),
            tools: Some(r#"[{"type":"function","function":{"name":"f"}}]"#.into()),
            sampling: Some(r#"{"temperature":0.7,"seed":3}"#.into()),
            partial: Some("tool_mismatch: turn 1".into()),
            prompt_ids_source: Some(spool::prompt::remote::IdsSource::Server),
        },
        ShardRow {
            id: "chat:1".into(),
            dataset: "chat".into(),
            row: (1 << 63) + 5,
            prompt: String::new(),
            messages: None,
            prompt_token_ids: None,
            completion: String::new(),
            completion_token_ids: Some(vec![]),
            prompt_tokens: 0,
            completion_tokens: u32::MAX,
            finish_reason: "length".into(),
            model: "test-model".into(),
            attempts: 3,
            latency_ms: 0,
            ttft_ms: None,
            completed_at_ms: 0,
            sample: 0,
            turn: 0,
            reasoning: None,
            tool_calls: None,
            tools: None,
            sampling: None,
            partial: None,
            prompt_ids_source: None,
        },
        ShardRow {
            id: "chat:2".into(),
            dataset: "chat".into(),
            row: 2,
            prompt: "p".repeat(10_000),
            messages: Some("[]".into()),
            prompt_token_ids: Some(vec![]),
            completion: "c".into(),
            completion_token_ids: None,
            prompt_tokens: 10_000,
            completion_tokens: 1,
            finish_reason: "stop".into(),
            model: "other".into(),
            attempts: 2,
            latency_ms: u32::MAX,
            ttft_ms: Some(0),
            completed_at_ms: 1_000,
            sample: 0,
            turn: 0,
            reasoning: None,
            tool_calls: None,
            tools: None,
            sampling: None,
            partial: None,
            prompt_ids_source: Some(spool::prompt::remote::IdsSource::Client),
        },
    ]
}

#[test]
fn shard_read_by_pyarrow_and_duckdb() {
    let dir = tempfile::tempdir().expect("tempdir");
    let metadata = vec![
        (schema::META_VERSION.to_string(), "0.1.0-test".to_string()),
        (schema::META_CONFIG_SHA256.to_string(), "0f".repeat(32)),
        (
            schema::META_SAMPLING.to_string(),
            r#"{"max_tokens":16,"temperature":0.0}"#.to_string(),
        ),
        (schema::META_COUNT_SOURCE.to_string(), "server".to_string()),
    ];
    let limits = ShardLimits {
        max_rows: 100,
        max_bytes: 1 << 30,
        compression_level: 9,
    };
    let written = rows();
    let mut writer = ShardWriter::create(
        dir.path(),
        0,
        &limits,
        metadata.clone(),
        &spool::knobs::Faults::default(),
    )
    .expect("create");
    writer.append(&written).expect("append");
    let sealed = writer.finish().expect("finish");

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .arg(root.join("tests/read_shard.py"))
        .arg(&sealed.path)
        .arg(root.join("schemas/shard.schema.json"))
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 (needed with pyarrow for this test): {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "tests/read_shard.py failed ({}); it needs pyarrow (pip install pyarrow duckdb):\n{stderr}",
        output.status
    );

    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("read_shard.py prints JSON");
    let readers = report["readers"].as_array().expect("readers");
    assert!(readers.iter().any(|r| r == "pyarrow"), "{report}");
    // CI installs DuckDB and sets this so a missing module can't skip the check silently.
    if std::env::var_os("SPOOL_TEST_REQUIRE_DUCKDB").is_some() {
        assert!(
            readers.iter().any(|r| r == "duckdb"),
            "SPOOL_TEST_REQUIRE_DUCKDB is set but read_shard.py could not import duckdb"
        );
    }

    let meta = report["metadata"].as_object().expect("metadata");
    for (key, value) in &metadata {
        assert_eq!(meta[key], *value, "metadata {key}");
    }
    assert_eq!(meta.len(), metadata.len(), "{meta:?}");

    let names: Vec<String> = schema::schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    let read: Vec<ShardRow> = report["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|row| {
            let mut object = row.as_object().expect("row object").clone();
            let keys: Vec<&String> = object.keys().collect();
            assert_eq!(keys, names.iter().collect::<Vec<_>>(), "column order");
            // pyarrow's column is `completed_at` (printed as unix ms); the struct says its unit.
            let at = object.remove("completed_at").expect("completed_at");
            object.insert("completed_at_ms".into(), at);
            serde_json::from_value(serde_json::Value::Object(object)).expect("row decodes")
        })
        .collect();
    assert_eq!(read, written);
}
