//! A cluster job is one job: its shape fixed once in the job record and checked by every
//! worker and command, a published job sealed against late commits and reruns, items that
//! failed for good published as failures and sent back through the store, `max_prompts`
//! a place in the file whatever the volume.

use crate::cluster::{cluster_config, ok, shared_folder_job};
use crate::process::{assert_verify_clean, edit_config, spool, Proc};
use crate::support::{fast_mock, write_prompts, Mock};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn manifest(shared: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(shared.join("_manifest.json")).unwrap()).unwrap()
}

fn status(cfg: &Path) -> Value {
    serde_json::from_str(&ok(cfg, &["status", "--json", "-q"], &[])).unwrap()
}

/// A 2-partition job's record fixes its shape: partition 0 run as part of a 3-partition
/// job is refused (exit 2) naming both counts, before it writes anything; `finalize`,
/// `verify` and `status` with another count are refused the same way (the finalize step
/// of a Slurm job has no array count of its own); a new budget is refused, and accepted
/// with `--reshape` as the record's next version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_partition_count_is_refused_everywhere() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    let shared = dir.path().join("shared");
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        2,
        40,
        1_000_000,
    );
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    let before = crate::forged::objects(&shared);
    let o = spool(
        &cfg,
        &["run", "-q", "--partition", "0", "--partitions", "3"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("partitions: the job record says 2, this one 3"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        crate::forged::objects(&shared),
        before,
        "a refused worker wrote to the store"
    );
    ok(&cfg, &["run", "-q", "--partition", "1"], &[]);
    for args in [
        &["finalize", "--partitions", "1"][..],
        &["verify", "--partitions", "1"],
        &["status", "--partitions", "3"],
    ] {
        let o = spool(&cfg, args, &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("partitions: the job record says 2, this one"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
    assert!(!shared.join("_manifest.json").exists());
    // Without a count of its own (the Slurm finalize step), the record's is used.
    let no_count = dir.path().join("no-count.toml");
    std::fs::write(
        &no_count,
        std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("partitions = 2\n", ""),
    )
    .unwrap();
    ok(&no_count, &["finalize"], &[]);
    assert_eq!(manifest(&shared)["datasets"]["alpha"]["items"], 40);
    assert_verify_clean(&no_count);
    // A new budget: refused without --reshape, a new version with it.
    edit_config(&cfg, "token_budget = 1000000", "token_budget = 2000000");
    let o = spool(&cfg, &["run", "-q", "--partition", "0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("token_budget: the job record says 1000000, this one 2000000"),
        "{}",
        stderr(&o)
    );
    mock.stop().await;
}

/// A finished job rerun with more input: without `--reshape` it is refused naming the
/// input; with it the worker first withdraws its done marker, so while it runs `status`
/// shows the partition not done and `finalize` refuses, and the next `finalize` publishes
/// all of it. Once published, a rerun of the same job has nothing to do (exit 0, nothing
/// written), and new input is refused: the job is sealed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_of_a_finished_job_is_not_done_until_it_is_and_a_published_one_is_sealed() {
    let dir = tempfile::tempdir().unwrap();
    // Slow enough that the rerun is still going while it is looked at.
    let (mock, shared, cfg) = shared_folder_job(dir.path(), (0.3, 0.1), 1, 20, 1_000_000).await;
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    assert!(shared.join("_spool/p0000/done.json").is_file());
    write_prompts(&dir.path().join("a.jsonl"), "a", 60);
    let o = spool(&cfg, &["run", "-q", "--partition", "0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("dataset `alpha` input: the job record says sha256"),
        "{}",
        stderr(&o)
    );
    let mut p = Proc::spawn(&cfg, &["run", "--partition", "0", "--reshape"], &[]);
    p.wait_for("cluster worker starting", 1, Duration::from_secs(60))
        .await;
    assert!(p.stderr().contains("job reshaped"), "{}", p.stderr());
    let st = status(&cfg);
    assert_eq!(st["partitions"][0]["done"], false, "{st}");
    let early = spool(&cfg, &["finalize"], &[]);
    assert_eq!(early.status.code(), Some(1), "{}", stderr(&early));
    assert!(
        stderr(&early).contains("have not finished"),
        "{}",
        stderr(&early)
    );
    let (s, _) = p.wait(Duration::from_secs(240)).await;
    assert!(s.success(), "{}", p.stderr());
    ok(&cfg, &["finalize"], &[]);
    assert_eq!(manifest(&shared)["datasets"]["alpha"]["items"], 60);
    assert_verify_clean(&cfg);
    // Published: the same job has nothing to do; new input is refused.
    let before = crate::forged::objects(&shared);
    let o = spool(&cfg, &["run", "--partition", "0"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("nothing to do"), "{}", stderr(&o));
    assert_eq!(crate::forged::objects(&shared), before);
    write_prompts(&dir.path().join("a.jsonl"), "a", 70);
    let o = spool(&cfg, &["run", "-q", "--partition", "0", "--reshape"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("published"), "{}", stderr(&o));
    assert_eq!(crate::forged::objects(&shared), before);
    mock.stop().await;
}

/// A twin worker (a zombie pod, a requeued task) holding a shard between its upload and
/// its commit while the job is finalized: its commit meets the seal and stops with an
/// error saying the job is published (exit 2); nothing is committed after the seal, and
/// the published output stays as the manifest says. While its sweep is held it still
/// beats, so the other worker sees it alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_committing_after_finalize_is_stopped_by_the_seal() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    let shared = dir.path().join("shared");
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        1,
        30,
        1_000_000,
    );
    let twin = dir.path().join("data-twin").display().to_string();
    let mut t = Proc::spawn(
        &cfg,
        &["run", "--partition", "0", "--data-dir", &twin],
        // Longer than the other worker's run, its wait for this one's next beat (up to
        // 15 s) and the finalize.
        &[("SPOOL_FAULT_PUBLISH_PAUSE_MS", "40000")],
    );
    t.wait_for(
        "fault injection: pausing publication",
        1,
        Duration::from_secs(60),
    )
    .await;
    let paused_at = spool::cluster::job::now_unix();
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    ok(&cfg, &["finalize"], &[]);
    // The twin kept beating while its sweep was held: the other worker saw it alive.
    let beats: Vec<serde_json::Value> = std::fs::read_dir(shared.join("_spool/p0000/writers"))
        .unwrap()
        .map(|e| serde_json::from_slice(&std::fs::read(e.unwrap().path()).unwrap()).unwrap())
        .collect();
    assert!(
        beats
            .iter()
            .any(|b| b["running"] == true && b["heartbeat_unix"].as_u64() > Some(paused_at)),
        "no beat of the held twin since {paused_at}: {beats:?}"
    );
    let published = manifest(&shared);
    let records = std::fs::read_dir(shared.join("_spool/p0000/commits"))
        .unwrap()
        .count();
    let (s, _) = t.wait(Duration::from_secs(120)).await;
    assert_eq!(s.code(), Some(2), "{}", t.stderr());
    assert!(
        t.stderr().contains("is sealed") && t.stderr().contains("published this job"),
        "{}",
        t.stderr()
    );
    assert_eq!(
        std::fs::read_dir(shared.join("_spool/p0000/commits"))
            .unwrap()
            .count(),
        records,
        "a record after the seal"
    );
    assert_eq!(manifest(&shared), published);
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// `max_prompts` is the first N lines of the file for the whole job: a partition run
/// again on an empty volume takes in no more than the job asked for (before, it skipped
/// what was committed and took N more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_prompts_holds_across_a_restart_on_an_empty_volume() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    let shared = dir.path().join("shared");
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        2,
        60,
        1_000_000,
    );
    edit_config(
        &cfg,
        "path = \"a.jsonl\"\n",
        "path = \"a.jsonl\"\nmax_prompts = 30\n",
    );
    for i in ["0", "1"] {
        ok(&cfg, &["run", "-q", "--partition", i], &[]);
    }
    std::fs::remove_dir_all(dir.path().join("data-0")).unwrap();
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    ok(&cfg, &["finalize"], &[]);
    let m = manifest(&shared);
    assert_eq!(m["datasets"]["alpha"]["items"], 30, "{m}");
    let ids = crate::cluster::published_ids(&shared, "alpha");
    let want: std::collections::BTreeSet<String> = (0..30).map(|i| format!("a{i}")).collect();
    assert_eq!(
        ids, want,
        "the first 30 lines, whichever partition owns them"
    );
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// An item that fails for good (the server refuses its prompt) does not keep its
/// partition from being done: the worker records it in the partition's log and exits 0,
/// `finalize` publishes the rest and lists it with its reason; `spool retry` sends it
/// back through the store (withdrawing the manifest and the done marker), and the
/// partition's next worker on a new, empty volume generates it; `finalize` then publishes
/// it with nothing failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_item_is_published_as_a_failure_and_retried_through_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let small = Mock::start(spool::mock::MockConfig {
        context_len: 64,
        ..fast_mock()
    })
    .await;
    let shared = dir.path().join("shared");
    let cfg = cluster_config(
        dir.path(),
        &small.url,
        &format!("file://{}", shared.display()),
        2,
        20,
        1_000_000,
    );
    // One prompt over the small server's context; the config's context length is large,
    // so intake takes it in and the server refuses it (HTTP 400, not retried).
    let long = "word ".repeat(300);
    let mut a = std::fs::read_to_string(dir.path().join("a.jsonl")).unwrap();
    a.push_str(&format!("{{\"id\": \"long\", \"prompt\": \"{long}\"}}\n"));
    std::fs::write(dir.path().join("a.jsonl"), a).unwrap();
    edit_config(&cfg, "[server]\n", "[server]\ncontext_length = 100000\n");
    let owner = spool::cluster::partition::owner("alpha", "long", 2);
    for i in 0..2 {
        let o = spool(&cfg, &["run", "-q", "--partition", &i.to_string()], &[]);
        assert_eq!(o.status.code(), Some(0), "partition {i}: {}", stderr(&o));
    }
    let st = status(&cfg);
    assert_eq!(st["partitions"][owner as usize]["done"], true, "{st}");
    assert_eq!(
        st["partitions"][owner as usize]["failed"]["alpha"], 1,
        "{st}"
    );
    let said = ok(&cfg, &["finalize"], &[]);
    assert!(said.contains("1 item(s) failed for good"), "{said}");
    let m = manifest(&shared);
    let failed = &m["datasets"]["alpha"]["failed"];
    assert_eq!(failed.as_array().unwrap().len(), 1, "{m}");
    assert_eq!(failed[0]["id"], "long");
    assert_eq!(failed[0]["partition"], owner);
    assert!(
        failed[0]["reason"].as_str().unwrap().contains("context"),
        "{failed}"
    );
    assert_eq!(m["datasets"]["alpha"]["items"], 20);
    assert_verify_clean(&cfg);
    // Back through the store; a new pod (an empty volume) picks it up.
    let said = ok(&cfg, &["retry"], &[]);
    assert!(
        said.contains(&format!("p{owner:04} alpha: 1 failed item(s) sent back")),
        "{said}"
    );
    assert!(
        !shared.join("_manifest.json").exists(),
        "manifest withdrawn"
    );
    assert_eq!(status(&cfg)["partitions"][owner as usize]["done"], false);
    let small_url = small.url.clone();
    small.stop().await;
    let big = Mock::start(fast_mock()).await;
    edit_config(&cfg, &small_url, &big.url);
    std::fs::remove_dir_all(dir.path().join(format!("data-{owner}"))).unwrap();
    ok(&cfg, &["run", "-q", "--partition", &owner.to_string()], &[]);
    ok(&cfg, &["finalize"], &[]);
    let m = manifest(&shared);
    assert_eq!(m["datasets"]["alpha"]["items"], 21, "{m}");
    assert!(m["datasets"]["alpha"].get("failed").is_none(), "{m}");
    assert!(crate::cluster::published_ids(&shared, "alpha").contains("long"));
    assert_verify_clean(&cfg);
    big.stop().await;
}

/// `finalize` run again skips what it published (one HEAD each, no copy); `--gc` then
/// removes every upload under `_spool/*/shards/` — the published shards' originals and
/// an orphan no record names — and the output still verifies clean. `--partial` names the
/// unfinished partition in the manifest and `status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finalize_reruns_skip_what_is_published_and_gc_removes_uploads() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(fast_mock()).await;
    let shared = dir.path().join("shared");
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        2,
        40,
        1_000_000,
    );
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    // Partition 1 has not run: --partial publishes partition 0 and names 1.
    let said = ok(&cfg, &["finalize", "--partial"], &[]);
    assert!(
        said.contains("partitions [1] published unfinished"),
        "{said}"
    );
    assert_eq!(manifest(&shared)["incomplete"], serde_json::json!([1]));
    let table = ok(&cfg, &["status"], &[]);
    assert!(table.contains("partitions [1] unfinished"), "{table}");
    // A worker of the sealed, unfinished partition is refused: the job is published.
    let o = spool(&cfg, &["run", "-q", "--partition", "1"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--partial"), "{}", stderr(&o));
    let orphan = shared.join("_spool/p0000/shards/0123456789abcdef/alpha/part-000009-0.parquet");
    std::fs::create_dir_all(orphan.parent().unwrap()).unwrap();
    std::fs::write(&orphan, b"an upload no record names").unwrap();
    let again = spool(&cfg, &["finalize", "--partial", "--gc"], &[]);
    let err = stderr(&again);
    assert!(again.status.success(), "{err}");
    let shards = manifest(&shared)["datasets"]["alpha"]["shards"]
        .as_array()
        .unwrap()
        .len()
        + manifest(&shared)["datasets"]["beta"]["shards"]
            .as_array()
            .unwrap()
            .len();
    assert!(
        err.contains(&format!("copied=0 skipped={shards}")),
        "a rerun copies nothing: {err}"
    );
    assert!(!orphan.exists(), "the orphan upload is gone");
    let left: Vec<String> = crate::forged::objects(&shared)
        .into_iter()
        .filter(|k| k.contains("/shards/"))
        .collect();
    assert!(left.is_empty(), "uploads left: {left:?}");
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// A worker killed with SIGKILL leaves its status saying it runs; its heartbeat ages, and
/// `status` shows the partition stale (no heartbeat for more than a minute: dead or cut
/// off) rather than running forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_shows_stale_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let (mock, shared, cfg) = shared_folder_job(dir.path(), (0.5, 0.2), 1, 100, 1_000_000).await;
    let mut p = Proc::spawn(&cfg, &["run", "--partition", "0"], &[]);
    p.wait_for("cluster worker starting", 1, Duration::from_secs(60))
        .await;
    p.signal(libc::SIGKILL);
    let _ = p.wait(Duration::from_secs(30)).await;
    let key = shared.join("_spool/p0000/status.json");
    let mut s: Value = serde_json::from_slice(&std::fs::read(&key).unwrap()).unwrap();
    assert_eq!(s["running"], true, "{s}");
    let st = status(&cfg);
    assert_eq!(st["partitions"][0]["stale"], false, "fresh: {st}");
    // Two minutes later, as far as the heartbeat says.
    let beat = s["heartbeat_unix"].as_u64().unwrap();
    s["heartbeat_unix"] = Value::from(beat - 120);
    std::fs::write(&key, serde_json::to_vec(&s).unwrap()).unwrap();
    let st = status(&cfg);
    assert_eq!(st["partitions"][0]["stale"], true, "{st}");
    assert!(st["partitions"][0]["heartbeat_age_s"].as_u64().unwrap() >= 120);
    let table = ok(&cfg, &["status"], &[]);
    assert!(table.contains("STALE: no heartbeat for"), "{table}");
    mock.stop().await;
}

/// A partition whose worker dies holding budget tickets does not strand them: partition 0
/// takes tickets, commits and is SIGKILLed for good; partition 1, budget-bound, finds the
/// pool empty and partition 0's heartbeat stale (here after a second), takes back its
/// unused allowance (a release in partition 0's log, returned to the pool) and uses it:
/// the job's tokens reach the budget, never pass it (policy "cancel").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_partitions_unused_budget_goes_back_to_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let mock = Mock::start(spool::mock::MockConfig {
        capacity_tps: 2.0,
        per_request_tps: 0.5,
        ..spool::mock::MockConfig::for_tests()
    })
    .await;
    let shared = dir.path().join("shared");
    let budget = 6_000;
    let cfg = cluster_config(
        dir.path(),
        &mock.url,
        &format!("file://{}", shared.display()),
        2,
        20,
        budget,
    );
    write_prompts(&dir.path().join("b.jsonl"), "b", 600);
    let mut p0 = Proc::spawn(&cfg, &["run", "--partition", "0"], &[]);
    p0.wait_for("shard committed", 2, Duration::from_secs(60))
        .await;
    p0.signal(libc::SIGKILL);
    let _ = p0.wait(Duration::from_secs(30)).await;
    let held: u64 = std::fs::read_dir(shared.join("_spool/budget/beta"))
        .unwrap()
        .map(|e| {
            serde_json::from_slice::<Value>(&std::fs::read(e.unwrap().path()).unwrap()).unwrap()
        })
        .filter(|t| t["partition"] == 0 && t["kind"] == "claim")
        .map(|t| t["tokens"].as_u64().unwrap())
        .sum();
    assert!(held > 0, "partition 0 took no ticket");
    let mut p1 = Proc::spawn(
        &cfg,
        &["run", "--partition", "1"],
        &[("SPOOL_FAULT_STALE_AFTER_MS", "1000")],
    );
    let (s, _) = p1.wait(Duration::from_secs(240)).await;
    assert!(s.success(), "{}", p1.stderr());
    assert!(
        p1.stderr()
            .contains("taking back the unused budget of a partition"),
        "{}",
        p1.stderr()
    );
    // Its outcome names what it was granted (the tickets it took and took back), not the
    // nothing it started with; what its queue holds past that is capped at publishing.
    let stderr = p1.stderr();
    let outcome = stderr
        .lines()
        .find(|l| l.contains("budget outcome") && l.contains("dataset=beta"))
        .unwrap_or_else(|| panic!("no budget outcome for beta: {stderr}"));
    let field = |k: &str| -> u64 {
        let v = outcome
            .split(&format!(" {k}="))
            .nth(1)
            .unwrap_or_else(|| panic!("{outcome}"));
        v.split(' ').next().unwrap().parse().unwrap()
    };
    assert!(
        field("budget") > 0 && field("overshoot") < field("completion_tokens") / 10,
        "{outcome}"
    );
    ok(&cfg, &["finalize", "--partial"], &[]);
    let tokens = manifest(&shared)["datasets"]["beta"]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        tokens <= budget && tokens >= budget * 97 / 100,
        "beta: {tokens} tokens of {budget} (partition 0 held {held})"
    );
    assert_verify_clean(&cfg);
    mock.stop().await;
}

/// A `file://` store is durable before a commit returns: the worker fsyncs each shard it
/// uploads and each commit record, and the folders their names are in (seen in the
/// binary's system calls), so after a power cut no record outlives its shard's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_store_is_fsynced_before_a_commit_returns() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let mock = Mock::start(fast_mock()).await;
    let shared = root.join("shared");
    let cfg = cluster_config(
        &root,
        &mock.url,
        &format!("file://{}", shared.display()),
        1,
        20,
        1_000_000,
    );
    let trace = root.join("trace");
    let st = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-e", "trace=fsync,fdatasync"])
        .args(["-e", "status=successful", "-o"])
        .arg(&trace)
        .arg(crate::support::spool_bin())
        .args(["run", "-q", "--partition", "0", "-c"])
        .arg(&cfg)
        .status()
        .unwrap();
    assert!(st.success());
    let synced: Vec<String> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .filter_map(|l| Some(l.split_once("sync(")?.1.to_string()))
        .collect();
    let shared_s = shared.display().to_string();
    let commits = format!("<{shared_s}/_spool/p0000/commits>)");
    let record = format!("<{shared_s}/_spool/p0000/commits/0000000000.json");
    let shard = |l: &String| {
        l.contains(&format!("<{shared_s}/_spool/p0000/shards/")) && l.contains(".parquet")
    };
    assert!(synced.iter().any(|l| l.contains(&commits)), "{synced:#?}");
    assert!(synced.iter().any(|l| l.contains(&record)), "{synced:#?}");
    assert!(synced.iter().any(shard), "{synced:#?}");
    mock.stop().await;
}
