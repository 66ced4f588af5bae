//! Nothing read from a store is trusted: commit records, done markers and `_manifest.json`
//! that spool's workers could not have written (forged, edited by hand, or another job's)
//! are named errors — `finalize` refuses and publishes nothing, `verify` names them, a
//! worker stops rather than skip the items they claim, `export` writes nothing outside its
//! output — and a shard object whose bytes are not the ones its record names is never
//! published.

use crate::cluster::{cluster_config, ok};
use crate::process::spool;
use crate::support::{fast_mock, Mock};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A one-partition job of `alpha` and `beta` (30 items each, 3 shards each) run to the end
/// on a shared folder `dir/shared`, not yet finalized. Returns the config and the folder.
pub(crate) async fn finished_job(dir: &Path) -> (PathBuf, PathBuf) {
    let mock = Mock::start(fast_mock()).await;
    let shared = dir.join("shared");
    let cfg = cluster_config(
        dir,
        &mock.url,
        &format!("file://{}", shared.display()),
        1,
        30,
        1_000_000,
    );
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    mock.stop().await;
    (cfg, shared)
}

/// Every file under `root`, relative, sorted.
pub(crate) fn objects(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

fn copy_tree(from: &Path, to: &Path) {
    for rel in objects(from) {
        let dest = to.join(&rel);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(from.join(&rel), dest).unwrap();
    }
}

fn commits_dir(shared: &Path) -> PathBuf {
    shared.join("_spool/p0000/commits")
}

/// The commit records of partition 0, in order.
fn records(shared: &Path) -> Vec<Value> {
    let dir = commits_dir(shared);
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap())
        .collect()
}

fn record_key(seq: usize) -> String {
    format!("_spool/p0000/commits/{seq:010}.json")
}

/// What a forgery does to a copy of the job's store; returns the key it planted.
type Forge = fn(&Path) -> String;

/// Plants `record` as the next record of partition 0.
fn append_record(shared: &Path, record: Value) -> String {
    let seq = records(shared).len();
    let key = record_key(seq);
    std::fs::write(
        shared.join(&key),
        serde_json::to_vec_pretty(&record).unwrap(),
    )
    .unwrap();
    key
}

/// Record 0 (an `alpha` shard) as the next record, changed by `edit`.
fn append_edited(shared: &Path, edit: impl Fn(&mut Value)) -> String {
    let mut r = records(shared)[0].clone();
    r["seq"] = Value::from(records(shared).len());
    edit(&mut r);
    append_record(shared, r)
}

/// Each forgery: a name, what it plants, and a word the error must say.
const FORGERIES: &[(&str, Forge, &str)] = &[
    (
        "a record publishing into the commit log",
        |s| append_edited(s, |r| r["dataset"] = "_spool/p0000/commits".into()),
        "dataset",
    ),
    (
        "a dataset name climbing out of the output",
        |s| append_edited(s, |r| r["dataset"] = "../../../../tmp/y".into()),
        "dataset",
    ),
    (
        "a record claiming another partition",
        |s| append_edited(s, |r| r["partition"] = 1.into()),
        "partition",
    ),
    (
        "a record claiming another sequence number",
        |s| append_edited(s, |r| r["seq"] = 99.into()),
        "seq",
    ),
    (
        "a record of a job with another partition count",
        |s| append_edited(s, |r| r["partitions"] = 4.into()),
        "partitions",
    ),
    (
        "a record holding items an earlier record holds",
        |s| append_edited(s, |_| {}),
        "earlier record",
    ),
    (
        "a record naming an object outside its partition's shards",
        |s| append_edited(s, |r| r["key"] = record_key(0).into()),
        "key",
    ),
    (
        "a record naming items but no shard",
        |s| {
            append_edited(s, |r| {
                r["key"] = Value::Null;
                r["rows"] = 0.into();
                r["ids"] = serde_json::json!(["a-forged-1", "a-forged-2"]);
            })
        },
        "no shard",
    ),
    (
        "a record whose checksum is not a sha256",
        |s| append_edited(s, |r| r["sha256"] = "0000".into()),
        "sha256",
    ),
    (
        "a stray object in the commit log",
        |s| {
            let key = "_spool/p0000/commits/zzz.parquet".to_string();
            std::fs::write(s.join(&key), b"not a record").unwrap();
            key
        },
        "not a commit record",
    ),
    (
        "another partition's done marker",
        |s| {
            let key = "_spool/p0000/done.json".to_string();
            let mut d: Value =
                serde_json::from_slice(&std::fs::read(s.join(&key)).unwrap()).unwrap();
            d["partition"] = 3.into();
            std::fs::write(s.join(&key), serde_json::to_vec(&d).unwrap()).unwrap();
            key
        },
        "partition",
    ),
];

/// Each kind of record spool's workers could not have written — a dataset name that is a
/// path (into the commit log, or out of the output), another partition's or sequence
/// number's record, another job's, items an earlier record holds, an object outside the
/// partition's shards, items without a shard, a bad checksum, a stray object in the log,
/// another partition's done marker — makes `finalize` fail naming the object, with no
/// object written anywhere in the store, and `verify` report it by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_are_named_errors_and_publish_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, shared) = finished_job(dir.path()).await;
    let pristine = dir.path().join("pristine");
    copy_tree(&shared, &pristine);
    for (what, forge, word) in FORGERIES {
        std::fs::remove_dir_all(&shared).unwrap();
        copy_tree(&pristine, &shared);
        let key = forge(&shared);
        let before = objects(&shared);
        let out = spool(&cfg, &["finalize"], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: finalize: {err}");
        assert!(
            err.contains(&key) && err.contains(word),
            "{what}: finalize must name {key} and say `{word}`: {err}"
        );
        assert_eq!(
            objects(&shared),
            before,
            "{what}: finalize wrote to the store"
        );
        let out = spool(&cfg, &["verify"], &[]);
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{what}: verify: {said}");
        assert!(
            said.contains(&key),
            "{what}: verify must name {key}: {said}"
        );
    }
    // The untouched store publishes and verifies clean.
    std::fs::remove_dir_all(&shared).unwrap();
    copy_tree(&pristine, &shared);
    ok(&cfg, &["finalize"], &[]);
    assert!(ok(&cfg, &["verify"], &[]).contains("verify: clean"));
}

/// A record of 20 items with no shard, planted before the worker starts, would have made
/// the worker skip those items (they look committed) and `verify` call the output clean.
/// The worker refuses to start, naming the record; once it is gone, every item is
/// published exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_items_without_a_shard_stops_the_worker_instead_of_losing_them() {
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
    std::fs::create_dir_all(commits_dir(&shared)).unwrap();
    let forged = serde_json::json!({
        "format": 1, "partition": 0, "partitions": 1, "seq": 0, "writer": "0123456789abcdef",
        "dataset": "alpha", "local_index": 0, "key": null, "rows": 0, "completion_tokens": 0,
        "bytes": 0, "sha256": "", "dropped": 20, "over_share": 0,
        "ids": (0..20).map(|i| format!("a{i}")).collect::<Vec<_>>(),
        "spool_version": "0.1.0",
    });
    let key = append_record(&shared, forged);
    let out = spool(&cfg, &["run", "-q", "--partition", "0"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "the worker ran: {err}");
    assert!(
        err.contains(&key) && err.contains("no shard"),
        "the error must name {key}: {err}"
    );
    let out = spool(&cfg, &["verify"], &[]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains(&key), "verify must name {key}: {said}");
    // With the forged record gone, nothing is missing.
    std::fs::remove_file(shared.join(&key)).unwrap();
    ok(&cfg, &["run", "-q", "--partition", "0"], &[]);
    ok(&cfg, &["finalize"], &[]);
    assert!(ok(&cfg, &["verify"], &[]).contains("verify: clean"));
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(shared.join("_manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["datasets"]["alpha"]["items"], 30);
    mock.stop().await;
}

/// A shard object whose bytes are not the ones its record names (replaced after the
/// commit) is not published: `finalize` fails naming the record and both checksums, the
/// published name is not left behind, and no manifest is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_bytes_differ_from_its_record_is_not_published() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, shared) = finished_job(dir.path()).await;
    let recs = records(&shared);
    let (first, second) = (
        recs[0]["key"].as_str().unwrap(),
        recs[1]["key"].as_str().unwrap(),
    );
    std::fs::copy(shared.join(second), shared.join(first)).unwrap();
    let out = spool(&cfg, &["finalize"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "finalize published it: {err}");
    assert!(
        err.contains(&record_key(0))
            && err.contains("sha256")
            && err.contains(recs[0]["sha256"].as_str().unwrap()),
        "{err}"
    );
    let published = format!(
        "{}/part-0000-000000.parquet",
        recs[0]["dataset"].as_str().unwrap()
    );
    assert!(
        !shared.join(&published).exists(),
        "{published} was left published"
    );
    assert!(!shared.join("_manifest.json").exists());
}

/// A manifest whose dataset names are paths — an absolute one, one climbing out of the
/// export's scratch folder, one naming a folder that holds a `part-000000.parquet` of
/// someone else's — makes `export` fail naming `_manifest.json`, with nothing written or
/// replaced outside its output; `verify` reports the names and a shard path that is not
/// the published name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_manifest_cannot_make_export_write_outside_its_output() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, shared) = finished_job(dir.path()).await;
    ok(&cfg, &["finalize"], &[]);
    let victim = dir.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("part-000000.parquet"), b"someone else's shard").unwrap();
    let absolute = dir.path().join("absolute");
    let tmp = dir.path().join("tmp/a/b");
    std::fs::create_dir_all(&tmp).unwrap();
    let manifest_path = shared.join("_manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    let alpha = m["datasets"]["alpha"].clone();
    for name in [
        absolute.display().to_string(),
        "../../../climbed".to_string(),
        victim.display().to_string(),
    ] {
        m["datasets"][name] = alpha.clone();
    }
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let exp = dir.path().join("exp");
    std::fs::create_dir_all(&exp).unwrap();
    let before: Vec<String> = objects(dir.path());
    let out = spool(
        &cfg,
        &[
            "export",
            "--format",
            "sharegpt",
            "--out",
            exp.join("a.jsonl").to_str().unwrap(),
        ],
        &[("TMPDIR", tmp.to_str().unwrap())],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "the export went on: {err}");
    assert!(err.contains("_manifest.json"), "{err}");
    assert_eq!(
        std::fs::read(victim.join("part-000000.parquet")).unwrap(),
        b"someone else's shard"
    );
    assert!(!absolute.exists(), "written to {}", absolute.display());
    assert_eq!(objects(dir.path()), before, "files appeared or went away");
    m["datasets"]["beta"]["shards"][0]["path"] = "../../outside.parquet".into();
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let out = spool(&cfg, &["verify"], &[]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("../../../climbed") && said.contains("../../outside.parquet"),
        "{said}"
    );
}

/// A cluster job's dataset may not take one of spool's own names under the prefix
/// (`_spool`, `_manifest.json`): the worker refuses to start (exit 2), naming the key.
#[test]
fn a_dataset_named_like_spools_own_objects_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = cluster_config(
        dir.path(),
        "http://127.0.0.1:9",
        &format!("file://{}", dir.path().join("shared").display()),
        1,
        3,
        1000,
    );
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("name = \"alpha\"", "name = \"_spool\"");
    std::fs::write(&cfg, text).unwrap();
    let out = spool(&cfg, &["run", "-q", "--partition", "0"], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("dataset.name") && err.contains("_spool"),
        "{err}"
    );
    assert!(!dir.path().join("shared/_spool/p0000/commits").exists());
}
