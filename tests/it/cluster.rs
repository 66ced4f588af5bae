//! Cluster jobs: partitions of one job as separate `spool` processes committing to one
//! object-store prefix, then `spool finalize`, `verify` and readers of the published output.

use crate::process::{spool, Proc};
use crate::support::{write_config, write_prompts, Ds, Mock};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Ids `{prefix}{i}` for i in 0..n.
fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// A two-dataset job config in `dir` writing to `output` with `partitions` partitions,
/// each partition's queue in `data-{partition}`; `beta` has `budget`.
pub(crate) fn cluster_config(
    dir: &Path,
    url: &str,
    output: &str,
    partitions: u32,
    per_dataset: usize,
    budget: u64,
) -> PathBuf {
    write_prompts(&dir.join("a.jsonl"), "a", per_dataset);
    write_prompts(&dir.join("b.jsonl"), "b", per_dataset);
    let cfg = write_config(
        dir,
        url,
        "sglang",
        true,
        &[
            Ds {
                name: "alpha",
                file: "a.jsonl",
                budget: None,
            },
            Ds {
                name: "beta",
                file: "b.jsonl",
                budget: Some(budget),
            },
        ],
        "",
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("data_dir = \"data\"", "data_dir = \"data-{partition}\"")
        .replace(
            "output_dir = \"out\"",
            &format!("output_dir = \"{output}\""),
        )
        .replace(
            "[run]\n",
            &format!("[run]\npartitions = {partitions}\nbudget_policy = \"cancel\"\n"),
        )
        .replace("max_rows = 25", "max_rows = 10");
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// Runs `spool <args>` and returns stdout, failing the test with its stderr otherwise.
pub(crate) fn ok(cfg: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = spool(cfg, args, env);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "spool {args:?}: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Rows of the published folder of each dataset, as pyarrow reads the whole folder:
/// (dataset → id → rows, dataset → completion tokens).
fn read_published_local(
    root: &Path,
) -> (
    HashMap<String, HashMap<String, usize>>,
    HashMap<String, u64>,
) {
    let script = r#"
import json, sys, pyarrow.dataset as ds
root = sys.argv[1]
out = {}
for name in ("alpha", "beta"):
    t = ds.dataset(f"{root}/{name}", format="parquet").to_table(columns=["id", "completion_tokens"])
    out[name] = {"ids": t.column("id").to_pylist(), "tokens": sum(t.column("completion_tokens").to_pylist())}
print(json.dumps(out))
"#;
    let py = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(root)
        .output()
        .expect("python3");
    assert!(
        py.status.success(),
        "{}",
        String::from_utf8_lossy(&py.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&py.stdout).unwrap();
    let mut rows = HashMap::new();
    let mut tokens = HashMap::new();
    for (name, d) in v.as_object().unwrap() {
        let mut m: HashMap<String, usize> = HashMap::new();
        for id in d["ids"].as_array().unwrap() {
            *m.entry(id.as_str().unwrap().to_string()).or_default() += 1;
        }
        rows.insert(name.clone(), m);
        tokens.insert(name.clone(), d["tokens"].as_u64().unwrap());
    }
    (rows, tokens)
}

/// Four partitions of one job, each its own process and `data_dir`, run at once against
/// one server and committing to one shared folder (`file://`): `finalize` publishes every
/// item of the unbudgeted dataset exactly once, the budgeted one within its budget (the
/// shares sum to it, each partition holds its share under `cancel`), pyarrow reads the
/// published folders, and `verify` and `status` see the whole job from the store alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_partitions_publish_every_item_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(crate::support::fast_mock()).await;
    let shared = dir.path().join("shared");
    let budget = 3_000;
    let n = 120;
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        4,
        n,
        budget,
    );
    // Before any worker: finalize refuses (no partition has finished).
    let early = spool(&cfg, &["finalize"], &[]);
    assert_eq!(
        early.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&early.stderr)
    );
    assert!(String::from_utf8_lossy(&early.stderr).contains("have not finished"));

    let mut procs: Vec<Proc> = (0..4)
        .map(|i| {
            let idx = i.to_string();
            Proc::spawn(&cfg, &["run"], &[("JOB_COMPLETION_INDEX", idx.as_str())])
        })
        .collect();
    for p in &mut procs {
        let (status, _) = p.wait(Duration::from_secs(120)).await;
        assert!(status.success(), "{status:?}\n{}", p.stderr());
    }
    // Each took only its own items, and said which partition it is.
    for (i, p) in procs.iter().enumerate() {
        assert!(
            p.stderr().contains(&format!("partition={i} partitions=4")),
            "{}",
            p.stderr()
        );
    }
    let stdout = ok(&cfg, &["finalize"], &[]);
    assert!(stdout.contains("published to"), "{stdout}");
    let (rows, tokens) = read_published_local(&shared);
    let alpha = &rows["alpha"];
    assert_eq!(alpha.len(), n, "alpha: every item published");
    for id in ids("a", n) {
        assert_eq!(alpha.get(&id), Some(&1), "alpha {id} exactly once");
    }
    let beta = &rows["beta"];
    assert!(beta.values().all(|&c| c == 1), "beta: no item twice");
    assert!(
        !beta.is_empty() && beta.len() < n,
        "beta is budget-bound: {}",
        beta.len()
    );
    assert!(
        tokens["beta"] <= budget,
        "beta: {} tokens > budget {budget}",
        tokens["beta"]
    );
    assert!(
        tokens["beta"] >= budget * 8 / 10,
        "beta used {} of its {budget}: shares left unused",
        tokens["beta"]
    );
    let verify = ok(&cfg, &["verify"], &[]);
    assert!(verify.contains("verify: clean"), "{verify}");
    let status: serde_json::Value =
        serde_json::from_str(&ok(&cfg, &["status", "--json", "-q"], &[])).unwrap();
    assert_eq!(status["finalized"], true);
    assert_eq!(status["partitions"].as_array().unwrap().len(), 4);
    assert!(status["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["done"] == true));
    let alpha_status = &status["datasets"][0];
    assert_eq!(alpha_status["items"], n as u64);
    mock.stop().await;
}
