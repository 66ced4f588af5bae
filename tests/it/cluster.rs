//! Cluster jobs: partitions of one job as separate `spool` processes committing to one
//! object-store prefix, then `spool finalize`, `verify` and readers of the published output.

use crate::process::{spool, Proc};
use crate::support::{write_config, write_prompts, Ds, Mock};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A [`cluster_config`] job on a shared folder (`file://<dir>/shared`) against a mock of
/// `(capacity, per-request)` tokens/s: the mock, the folder and the config.
pub(crate) async fn shared_folder_job(
    dir: &Path,
    (capacity_tps, per_request_tps): (f64, f64),
    partitions: u32,
    per_dataset: usize,
    budget: u64,
) -> (Mock, PathBuf, PathBuf) {
    let mock = Mock::start(spool::mock::MockConfig {
        capacity_tps,
        per_request_tps,
        ..spool::mock::MockConfig::for_tests()
    })
    .await;
    let shared = dir.join("shared");
    let output = format!("file://{}", shared.display());
    let cfg = cluster_config(dir, &mock.url, &output, partitions, per_dataset, budget);
    (mock, shared, cfg)
}

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

/// Each dataset's published folder as pyarrow reads it, from a local folder, or through
/// `s3://` when `endpoint` (moto's `127.0.0.1:PORT`) is given: id → rows, and tokens.
fn read_published(root: &str, endpoint: Option<&str>) -> Published {
    let script = r#"
import json, sys, pyarrow.fs as fs, pyarrow.dataset as ds
root, endpoint = sys.argv[1], sys.argv[2]
fsys = None
if endpoint:
    fsys = fs.S3FileSystem(endpoint_override=endpoint, scheme="http", access_key="test",
                           secret_key="test-secret", region="us-east-1")
out = {}
for name in ("alpha", "beta"):
    t = ds.dataset(f"{root}/{name}", filesystem=fsys, format="parquet").to_table(columns=["id", "completion_tokens"])
    out[name] = {"ids": t.column("id").to_pylist(), "tokens": sum(t.column("completion_tokens").to_pylist())}
print(json.dumps(out))
"#;
    let py = std::process::Command::new("python3")
        .args(["-c", script, root, endpoint.unwrap_or("")])
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
    Published { rows, tokens }
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
    // Two bad rows: each is reported by exactly one partition.
    let mut a = std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap();
    a.push_str("not json at all\n{\"id\": \"a-bad\", \"prompt\": 5}\n");
    std::fs::write(dir.path().join("a.jsonl"), a).unwrap();
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
    let Published { rows, tokens } = read_published(&shared.display().to_string(), None);
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
    let rejected: Vec<String> = std::fs::read_dir(shared.join("alpha"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("_rejected-")
        })
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(rejected.len(), 2, "each bad row once: {rejected:?}");
    assert!(
        rejected.iter().any(|l| l.contains("\"line\":121")),
        "{rejected:?}"
    );
    assert!(
        rejected.iter().any(|l| l.contains("\"line\":122")),
        "{rejected:?}"
    );
    let verify = ok(&cfg, &["verify"], &[]);
    assert!(verify.contains("verify: clean"), "{verify}");
    // Exports read the published shards (fetched and checked against the manifest).
    let out = dir.path().join("alpha.jsonl").display().to_string();
    let said = ok(
        &cfg,
        &[
            "export",
            "--format",
            "sharegpt",
            "--dataset",
            "alpha",
            "--out",
            &out,
        ],
        &[],
    );
    assert!(said.contains(&format!("{n} row(s)")), "{said}");
    let mut exported: Vec<String> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    exported.sort();
    let mut want = ids("a", n);
    want.sort();
    assert_eq!(
        exported, want,
        "the export holds every published alpha item once"
    );
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

/// The ids in a dataset's published folder under a shared-folder prefix (spool's own
/// shard reader; pyarrow reads them in the tests above).
pub(crate) fn published_ids(shared: &Path, dataset: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(shared.join(dataset)).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "parquet") {
            for (id, _) in spool::output::reader::read_keys(&p).unwrap() {
                out.insert(id);
            }
        }
    }
    out
}

/// What a chaotic cluster job left: the published rows per dataset and the budget.
pub(crate) struct Published {
    pub rows: HashMap<String, HashMap<String, usize>>,
    pub tokens: HashMap<String, u64>,
}

/// Whether `p` has exited, without reaping it (a zombie can still be signalled, and
/// `Proc::wait` reaps it).
fn exited(p: &Proc) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", p.pid())).map_or(true, |stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z'))
    })
}

/// Polls until `p` has logged `needle` `n` times, or has exited.
async fn wait_for_or_exit(p: &mut Proc, needle: &str, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while p.count(needle) < n && std::time::Instant::now() < deadline {
        if exited(p) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The cluster's failure cases in one job of four partitions × two datasets, against
/// `output` (with `env` for the store): partition 0 is SIGKILLed at random moments after
/// it has committed and restarted on its volume; partition 1 runs twice at once on two
/// volumes; partition 2 is SIGKILLed and restarted on an empty `data_dir`; partition 3
/// runs once. Then `finalize` and `verify`. Returns the stderr of every process.
pub(crate) async fn chaos_job(
    dir: &Path,
    cfg: &Path,
    env: &[(&str, &str)],
    seed: u64,
) -> Vec<String> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    eprintln!("cluster chaos: seed {seed}");
    let spawn_with = |index: u32, data_dir: Option<&str>, extra: &[(&str, &str)]| {
        let idx = index.to_string();
        let mut e: Vec<(&str, &str)> = env.to_vec();
        e.extend_from_slice(extra);
        e.push(("JOB_COMPLETION_INDEX", idx.as_str()));
        match data_dir {
            Some(d) => Proc::spawn(cfg, &["run", "--data-dir", d], &e),
            None => Proc::spawn(cfg, &["run"], &e),
        }
    };
    let spawn = |index: u32, data_dir: Option<&str>| spawn_with(index, data_dir, &[]);
    let mut logs = Vec::new();
    let twin = dir.join("data-twin").display().to_string();
    // Partition 1 twice at once, partition 3 once; they run through what follows.
    let mut steady = vec![spawn(1, None), spawn(1, Some(&twin)), spawn(3, None)];
    // Partition 0: killed between a shard's upload and its commit record, then three
    // times after a commit at a random moment; always the same volume.
    let mut p = spawn_with(0, None, &[("SPOOL_FAULT_PUBLISH_PAUSE_MS", "1000")]);
    wait_for_or_exit(&mut p, "fault injection: pausing publication", 1).await;
    assert_eq!(
        p.count("fault injection: pausing publication"),
        1,
        "{}",
        p.stderr()
    );
    p.signal(libc::SIGKILL);
    let _ = p.wait(Duration::from_secs(30)).await;
    logs.push(p.stderr());
    for _ in 0..3 {
        let mut p = spawn(0, None);
        let commits = p.count("shard committed") + 1;
        wait_for_or_exit(&mut p, "shard committed", commits).await;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..400))).await;
        p.signal(libc::SIGKILL);
        let _ = p.wait(Duration::from_secs(30)).await;
        logs.push(p.stderr());
    }
    // Partition 2: killed after a commit, then its volume is gone (a new pod).
    let mut p = spawn(2, None);
    wait_for_or_exit(&mut p, "shard committed", 1).await;
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
    p.signal(libc::SIGKILL);
    let _ = p.wait(Duration::from_secs(30)).await;
    logs.push(p.stderr());
    std::fs::remove_dir_all(dir.join("data-2")).unwrap();
    steady.push(spawn(2, None));
    steady.push(spawn(0, None));
    for p in &mut steady {
        let (status, _) = p.wait(Duration::from_secs(300)).await;
        assert!(status.success(), "{status:?}\n{}", p.stderr());
        logs.push(p.stderr());
    }
    let fin = ok(cfg, &["finalize"], env);
    assert!(fin.contains("published to"), "{fin}");
    let verify = ok(cfg, &["verify"], env);
    assert!(verify.contains("verify: clean"), "{verify}");
    logs
}

/// Checks what `chaos_job` published: every alpha item exactly once, beta's items at most
/// once and its tokens within the budget (under `cancel`, each partition's commits stay
/// within its allowance even with two workers on it) and, with `within` (a fraction), no
/// further from it than that — under `cancel` below it, under `finish` on either side;
/// and the failure cases really happened (with `store_faults`, partition 1's twins may
/// not overlap: one's start-up can be held until the other has committed).
pub(crate) fn assert_chaos_outcome(
    p: &Published,
    logs: &[String],
    n: usize,
    budget: u64,
    within: Option<(f64, &str)>,
    store_faults: bool,
) {
    let alpha = &p.rows["alpha"];
    let missing: Vec<_> = ids("a", n)
        .into_iter()
        .filter(|i| !alpha.contains_key(i))
        .collect();
    assert!(missing.is_empty(), "alpha items missing: {missing:?}");
    let twice: Vec<_> = alpha.iter().filter(|(_, &c)| c != 1).collect();
    assert!(twice.is_empty(), "alpha items not once: {twice:?}");
    assert_eq!(alpha.len(), n);
    let beta = &p.rows["beta"];
    assert!(beta.values().all(|&c| c == 1), "beta item twice");
    let tokens = p.tokens["beta"];
    // Every worker's log, for a closer look: `SPOOL_CHAOS_LOGS=<dir>`.
    if let Some(dir) = std::env::var_os("SPOOL_CHAOS_LOGS") {
        for (k, l) in logs.iter().enumerate() {
            let _ = std::fs::write(Path::new(&dir).join(format!("worker-{k}.log")), l);
        }
    }
    // What each worker said of the budget, to see where it went.
    let said: Vec<String> = logs
        .iter()
        .enumerate()
        .flat_map(|(k, l)| l.lines().map(move |line| (k, line)))
        .filter(|(_, l)| {
            l.contains("unused budget")
                || l.contains("partition's budget")
                || (l.contains("would pass the partition's allowance")
                    && !l.contains("over_share=0"))
                || l.contains("budget reached")
                || l.contains("taking back")
                || l.contains("finishes on what it holds")
                || l.contains("taking no more budget")
        })
        .map(|(k, l)| format!("[worker {k}] {}", l.get(11..).unwrap_or(l)))
        .collect();
    eprintln!(
        "cluster chaos: beta {tokens} tokens of a budget of {budget}, {} items\n{}",
        beta.len(),
        said.join("\n")
    );
    match within {
        None => assert!(tokens <= budget, "beta {tokens} > budget {budget}"),
        Some((fraction, policy)) => {
            let slack = (budget as f64 * fraction) as u64;
            let high = if policy == "cancel" {
                budget
            } else {
                budget + slack
            };
            assert!(
                (budget - slack..=high).contains(&tokens),
                "beta: {tokens} tokens, the budget {budget} ± {slack} under {policy}\n{}",
                said.join("\n")
            );
        }
    }
    let all = logs.join("\n");
    // The empty volume rebuilt from the store: its intake skipped committed items.
    assert!(
        all.lines().any(|l| l.contains("partition's rows taken in")
            && l.contains("partition=2")
            && !l.contains("committed=0")),
        "partition 2 did not skip committed items on its new volume"
    );
    // The twin workers of partition 1 both generated, and one lost a race; or, with
    // `store_faults` holding one's start-up (retries and timeouts: half a minute has been
    // seen), it took in only what the other had not committed yet.
    let met = all.contains("committed by another worker first")
        || all.contains("another worker committed first");
    let late = store_faults
        && all.lines().any(|l| {
            l.contains("partition's rows taken in")
                && l.contains("partition=1 ")
                && !l.contains("committed=0")
        });
    assert!(met || late, "the two workers of partition 1 never met");
}

/// The cluster's failure cases on a shared folder (`file://`): kills, a rescheduled worker
/// on an empty volume, two workers on one partition; every item published once, budgets
/// held, verify clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_new_volumes_and_twin_workers_publish_each_item_once() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(spool::mock::MockConfig {
        capacity_tps: 4.0,
        per_request_tps: 1.0,
        ..spool::mock::MockConfig::for_tests()
    })
    .await;
    let shared = dir.path().join("shared");
    let (n, budget) = (200, 4_000);
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        4,
        n,
        budget,
    );
    let seed = std::env::var("SPOOL_CLUSTER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let logs = chaos_job(dir.path(), &cfg, &[], seed).await;
    let published = read_published(&shared.display().to_string(), None);
    assert_chaos_outcome(&published, &logs, n, budget, None, false);
    mock.stop().await;
}

/// The acceptance run against a real S3 API (moto) behind a proxy injecting 503 SlowDown,
/// resets after the store acted, slow answers and 409 `ConditionalRequestConflict` to
/// conditional creates: 4 partitions × 2 datasets, one input a `.jsonl.zst` object, one
/// dataset with a budget shared across the partitions (tickets from one pool), SIGKILLs
/// at random moments, a partition restarted on an empty `data_dir`, one run twice at
/// once. From the objects alone (pyarrow over `s3://`) every prompt of the unbudgeted
/// dataset is published exactly once, none of the other twice, and its tokens are within
/// 0.5 % of the budget (never over under `cancel`); `verify` is clean.
async fn s3_chaos(policy: &str) {
    use crate::s3::{FaultPlan, FaultProxy, Moto};
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start();
    moto.create_bucket("spool-cluster");
    let proxy = FaultProxy::start(
        &moto.endpoint,
        FaultPlan {
            every_503: 7,
            every_reset: 11,
            every_delay: 37,
            delay: Duration::from_millis(2500),
            every_conflict: 5,
            ..FaultPlan::default()
        },
    )
    .await;
    let mock = Mock::start(spool::mock::MockConfig {
        capacity_tps: 4.0,
        per_request_tps: 1.0,
        ..spool::mock::MockConfig::for_tests()
    })
    .await;
    // beta's demand (3,000 items of about 50 tokens) is well above its budget, even with
    // partition 1's twins spending theirs on duplicates and leaving items unmade (the
    // others then make up for them); four requests in flight per worker keep the end of
    // the budget's variance small against 0.5 %.
    let (n, budget) = (200, 80_000);
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        "s3://spool-cluster/gen/run-1",
        4,
        n,
        budget,
    );
    write_prompts(&dir.path().join("b.jsonl"), "b", 3_000);
    // alpha's prompts are an object in the bucket, zstd-compressed.
    let raw = std::fs::read(dir.path().join("a.jsonl")).unwrap();
    let zst = dir.path().join("a.jsonl.zst");
    std::fs::write(&zst, zstd::encode_all(&raw[..], 3).unwrap()).unwrap();
    let inputs = crate::s3::s3_bucket(&moto.endpoint, "s3://spool-cluster/inputs");
    inputs.upload("a.jsonl.zst", &zst).await.unwrap();
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            "path = \"a.jsonl\"",
            "path = \"s3://spool-cluster/inputs/a.jsonl.zst\"",
        )
        .replace("[sampling]", "[storage]\ntimeout_s = 2\n\n[sampling]")
        .replace(
            "budget_policy = \"cancel\"",
            &format!("budget_policy = \"{policy}\""),
        )
        .replace("concurrency = 16", "concurrency = 4");
    std::fs::write(&cfg, text).unwrap();
    std::fs::remove_file(dir.path().join("a.jsonl")).unwrap();
    let env_owned = Moto::env(&proxy.endpoint);
    let env: Vec<(&str, &str)> = env_owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let seed = std::env::var("SPOOL_CLUSTER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let logs = chaos_job(dir.path(), &cfg, &env, seed).await;
    let endpoint = moto.endpoint.trim_start_matches("http://");
    let published = read_published("spool-cluster/gen/run-1", Some(endpoint));
    assert_chaos_outcome(&published, &logs, n, budget, Some((0.005, policy)), true);
    let c = &proxy.counts;
    use std::sync::atomic::Ordering::SeqCst;
    let (s, r, d, k) = (
        c.slowdowns.load(SeqCst),
        c.resets.load(SeqCst),
        c.delays.load(SeqCst),
        c.conflicts.load(SeqCst),
    );
    assert!(
        s > 0 && r > 0 && d > 0 && k > 0,
        "faults: {s} slowdowns, {r} resets, {d} delays, {k} 409 conflicts"
    );
    // The manifest is what readers wait for, and lists what they read.
    let manifest = inputs_manifest(&moto.endpoint).await;
    assert_eq!(manifest["datasets"]["alpha"]["items"], n as u64);
    assert_eq!(manifest["datasets"]["beta"]["budget"], budget);
    mock.stop().await;
}

/// [`s3_chaos`] under `budget_policy = "cancel"`: the budget is never passed, and at most
/// 0.5 % of it is left unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_cluster_job_survives_kills_new_volumes_twins_and_store_faults() {
    s3_chaos("cancel").await;
}

/// [`s3_chaos`] under `budget_policy = "finish"`: the job's tokens are within 0.5 % of the
/// budget on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_cluster_job_shares_its_budget_under_finish() {
    s3_chaos("finish").await;
}

async fn inputs_manifest(endpoint: &str) -> serde_json::Value {
    let b = crate::s3::s3_bucket(endpoint, "s3://spool-cluster/gen/run-1");
    let body = b
        .get("_manifest.json")
        .await
        .unwrap()
        .expect("_manifest.json");
    serde_json::from_slice(&body).unwrap()
}

/// `spool status` of a cluster job shows a running partition's pending items from the
/// store (its worker copies its live `/status` there), then where it stood when it was
/// stopped; a partition that never ran shows nothing pending and not done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_running_partition_live_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, _, cfg) = shared_folder_job(dir.path(), (0.5, 0.2), 2, 300, 100_000).await;
    crate::process::edit_config(
        &cfg,
        "metrics_addr = \"\"",
        "metrics_addr = \"127.0.0.1:0\"",
    );
    let mut p = Proc::spawn(&cfg, &["run"], &[("JOB_COMPLETION_INDEX", "0")]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let live = loop {
        let st: serde_json::Value =
            serde_json::from_str(&ok(&cfg, &["status", "--json", "-q"], &[])).unwrap();
        let p0 = st["partitions"][0].clone();
        if p0["live"] == true && p0["pending"]["alpha"].as_u64().is_some_and(|n| n > 0) {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never live: {st}\n{}",
            p.stderr()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(live["partitions"][1]["done"], false);
    assert_eq!(live["partitions"][1]["commits"], 0);
    assert!(live["partitions"][1]["pending"]
        .as_object()
        .unwrap()
        .is_empty());
    let table = ok(&cfg, &["status"], &[]);
    assert!(table.contains("pending (running)"), "{table}");
    p.signal(libc::SIGTERM);
    let (status, _) = p.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(130), "{}", p.stderr());
    let st: serde_json::Value =
        serde_json::from_str(&ok(&cfg, &["status", "--json", "-q"], &[])).unwrap();
    let p0 = &st["partitions"][0];
    assert_eq!(p0["live"], false, "{st}");
    assert_eq!(
        p0["done"], false,
        "an interrupted partition is not done: {st}"
    );
    assert!(
        p0["pending"]["alpha"].as_u64().is_some_and(|n| n > 0),
        "{st}"
    );
    mock.stop().await;
}

/// Store credentials never leave the environment: a worker logging at trace level, its
/// `data_dir`, `finalize`, `status` and every object it wrote hold no trace of the secret
/// key or the session token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_credentials_are_never_logged_or_written() {
    use crate::s3::Moto;
    let dir = tempfile::tempdir().unwrap();
    let moto = Moto::start();
    moto.create_bucket("spool-secrets");
    let mock = Mock::start(crate::support::fast_mock()).await;
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        "s3://spool-secrets/run",
        1,
        30,
        100_000,
    );
    let secret = "SeCrEt-7f3a9c1e5b2d4f6a8c0e";
    let token = "ToKeN-1b2c3d4e5f60718293a4";
    let mut env: Vec<(String, String)> = Moto::env(&moto.endpoint)
        .into_iter()
        .filter(|(k, _)| k != "AWS_SECRET_ACCESS_KEY")
        .collect();
    env.push(("AWS_SECRET_ACCESS_KEY".into(), secret.into()));
    env.push(("AWS_SESSION_TOKEN".into(), token.into()));
    env.push(("RUST_LOG".into(), "trace".into()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut p = Proc::spawn(&cfg, &["run", "-vv", "--partition", "0"], &env);
    let (status, _) = p.wait(Duration::from_secs(120)).await;
    assert!(status.success(), "{}", p.stderr());
    let mut said = p.stderr();
    assert!(
        said.contains("shard committed"),
        "the worker published nothing"
    );
    for args in [
        &["finalize", "-vv"][..],
        &["status", "--json"],
        &["verify", "-vv"],
    ] {
        let out = spool(&cfg, args, &env);
        said.push_str(&String::from_utf8_lossy(&out.stdout));
        said.push_str(&String::from_utf8_lossy(&out.stderr));
    }
    for needle in [secret, token] {
        assert!(!said.contains(needle), "a credential in the output");
    }
    let mut files = vec![dir.path().to_path_buf()];
    let mut read = 0;
    while let Some(f) = files.pop() {
        if f.is_dir() {
            files.extend(std::fs::read_dir(&f).unwrap().map(|e| e.unwrap().path()));
        } else {
            let bytes = std::fs::read(&f).unwrap();
            read += 1;
            for needle in [secret, token] {
                assert!(
                    !bytes.windows(needle.len()).any(|w| w == needle.as_bytes()),
                    "a credential in {}",
                    f.display()
                );
            }
        }
    }
    assert!(read > 10, "only {read} files looked at");
    let b = crate::s3::s3_bucket(&moto.endpoint, "s3://spool-secrets/run");
    let objects = b.list("").await.unwrap();
    assert!(
        objects.iter().any(|(k, _)| k == "_manifest.json"),
        "{objects:?}"
    );
    for (key, _) in &objects {
        let body = b.get(key).await.unwrap().unwrap();
        for needle in [secret, token] {
            assert!(
                !body.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "a credential in {key}"
            );
        }
    }
    mock.stop().await;
}
