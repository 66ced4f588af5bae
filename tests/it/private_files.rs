//! What spool writes on a shared machine: scratch folders no other user can plant or read,
//! files and folders with explicit modes whatever the umask, an export that never deletes
//! a folder it did not write, and an export's name made durable.

use crate::cluster::ok;
use crate::forged::{finished_job, objects};
use crate::process::spool;
use crate::support::*;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// `spool <args> -c cfg` under `umask`, with extra env vars.
fn spool_umask(
    cfg: &Path,
    args: &[&str],
    umask: u32,
    env: &[(&str, &str)],
) -> std::process::Output {
    let mut c = Command::new(spool_bin());
    c.args(args).arg("-c").arg(cfg);
    for (k, v) in env {
        c.env(k, v);
    }
    unsafe {
        c.pre_exec(move || {
            libc::umask(umask as libc::mode_t);
            Ok(())
        });
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "spool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The pids the next processes will most likely get: the `n` after the last one given.
fn next_pids(n: i64) -> Vec<i64> {
    let last: i64 = std::fs::read_to_string("/proc/sys/kernel/ns_last_pid")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let max: i64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (1..=n)
        .map(|i| {
            let p = last + i;
            if p >= max {
                p - max + 300
            } else {
                p
            }
        })
        .collect()
}

/// Another user who pre-creates `spool-verify-<pid>` and `spool-export-<pid>` in `$TMPDIR`
/// for the pids to come, as symlinks to a folder of theirs whose download names are
/// symlinks to the victim's files, gets nothing: `verify` and a cluster `export` make
/// fresh private scratch folders, so the victim's files keep their bytes, and no scratch
/// is left behind in `$TMPDIR` or beside the export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_scratch_folder_is_not_used() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _shared) = finished_job(dir.path()).await;
    ok(&cfg, &["finalize"], &[]);
    let tmp = dir.path().join("tmp");
    let theirs = dir.path().join("theirs");
    std::fs::create_dir_all(theirs.join("alpha")).unwrap();
    std::fs::create_dir_all(&tmp).unwrap();
    let victims: Vec<PathBuf> = ["victim-1", "victim-2"]
        .iter()
        .map(|v| dir.path().join(v))
        .collect();
    for v in &victims {
        std::fs::write(v, b"root's private bytes").unwrap();
        std::fs::set_permissions(v, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    std::os::unix::fs::symlink(&victims[0], theirs.join(".shard.parquet.part")).unwrap();
    std::os::unix::fs::symlink(&victims[1], theirs.join("alpha/.part-000000.parquet.part"))
        .unwrap();
    for pid in next_pids(3000) {
        for cmd in ["verify", "export"] {
            std::os::unix::fs::symlink(&theirs, tmp.join(format!("spool-{cmd}-{pid}"))).unwrap();
        }
    }
    let planted = std::fs::read_dir(&tmp).unwrap().count();
    let env = [("TMPDIR", tmp.to_str().unwrap())];
    let said = ok(&cfg, &["verify"], &env);
    assert!(said.contains("verify: clean"), "{said}");
    let exp = dir.path().join("exp");
    std::fs::create_dir_all(&exp).unwrap();
    ok(
        &cfg,
        &[
            "export",
            "--format",
            "sharegpt",
            "--out",
            exp.join("a.jsonl").to_str().unwrap(),
        ],
        &env,
    );
    for v in &victims {
        let kept = std::fs::read(v).unwrap() == b"root's private bytes";
        assert!(
            kept,
            "{} was overwritten through a planted symlink",
            v.display()
        );
    }
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        planted,
        "scratch left in $TMPDIR"
    );
    let mut left: Vec<String> = std::fs::read_dir(&exp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["a.jsonl", "a.jsonl.summary.json"]);
}

/// A local job's config (40 prompts and a rejected row) and its mock server.
async fn job(dir: &Path) -> (PathBuf, Mock) {
    let mock = Mock::start(fast_mock()).await;
    write_prompts(&dir.join("p.jsonl"), "p", 40);
    let mut rows = std::fs::read_to_string(dir.join("p.jsonl")).unwrap();
    rows.push_str("not json\n");
    std::fs::write(dir.join("p.jsonl"), rows).unwrap();
    let cfg = write_config(
        dir,
        &mock.url,
        "completions",
        false,
        &[Ds {
            name: "a",
            file: "p.jsonl",
            budget: None,
        }],
        "",
    );
    (cfg, mock)
}

/// Under a loose umask (022) shards, the rejected-rows file, the queue's files and both
/// exports are 0640 and their folders 0750; under a strict one (077) they are 0600 and
/// 0700: the umask only ever takes away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_are_0640_and_folders_0750_unless_the_umask_is_stricter() {
    for (umask, file, folder) in [(0o022, 0o640, 0o750), (0o077, 0o600, 0o700)] {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, _mock) = job(dir.path()).await;
        spool_umask(&cfg, &["run", "-q"], umask, &[]);
        let exp = dir.path().join("exp");
        spool_umask(
            &cfg,
            &[
                "export",
                "--format",
                "sharegpt",
                "--out",
                exp.join("a.jsonl").to_str().unwrap(),
            ],
            umask,
            &[],
        );
        spool_umask(
            &cfg,
            &[
                "export",
                "--format",
                "hf",
                "--out",
                exp.join("hf").to_str().unwrap(),
            ],
            umask,
            &[],
        );
        let shards = shard_files(&dir.path().join("out"), "a");
        assert!(shards.len() >= 2);
        let mut files: Vec<PathBuf> = shards;
        files.push(dir.path().join("out/a/_rejected.jsonl"));
        files.push(exp.join("a.jsonl"));
        files.push(exp.join("a.jsonl.summary.json"));
        files.push(exp.join("hf/README.md"));
        files.push(exp.join("hf.summary.json"));
        for f in std::fs::read_dir(exp.join("hf/data")).unwrap() {
            files.push(f.unwrap().path());
        }
        for f in &files {
            assert_eq!(mode(f), file, "{} under umask {umask:03o}", f.display());
        }
        for d in [
            dir.path().join("out"),
            dir.path().join("out/a"),
            exp.clone(),
            exp.join("hf"),
            exp.join("hf/data"),
        ] {
            assert_eq!(mode(&d), folder, "{} under umask {umask:03o}", d.display());
        }
        // The queue: no file or folder with more than those modes.
        let mut stack = vec![dir.path().join("data")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let allowed = if p.is_dir() {
                    stack.push(p.clone());
                    folder
                } else {
                    file
                };
                let m = mode(&p);
                assert_eq!(m & !allowed & 0o777, 0, "{}: {m:o}", p.display());
            }
        }
    }
}

/// `export --format hf --out DIR` never deletes a folder it did not write: a folder with
/// someone's files is refused (exit 2) and left as it was; an earlier `hf` export is
/// replaced; `--force` moves the folder aside, saying where, and exports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_refuses_a_folder_that_is_not_a_spool_export() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _mock) = job(dir.path()).await;
    ok(&cfg, &["run", "-q"], &[]);
    let theirs = dir.path().join("theirs");
    std::fs::create_dir_all(theirs.join("notes")).unwrap();
    std::fs::write(theirs.join("notes/thesis.tex"), b"three years of work").unwrap();
    let before = objects(dir.path());
    let out = spool(
        &cfg,
        &[
            "export",
            "--format",
            "hf",
            "--out",
            theirs.to_str().unwrap(),
        ],
        &[],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(theirs.to_str().unwrap()) && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        objects(dir.path()),
        before,
        "the refused export changed files"
    );
    // An earlier spool export is replaced.
    let hf = dir.path().join("hf");
    ok(
        &cfg,
        &["export", "--format", "hf", "--out", hf.to_str().unwrap()],
        &[],
    );
    ok(
        &cfg,
        &["export", "--format", "hf", "--out", hf.to_str().unwrap()],
        &[],
    );
    assert!(hf.join("README.md").is_file());
    // --force moves theirs aside.
    let said = ok(
        &cfg,
        &[
            "export",
            "--format",
            "hf",
            "--force",
            "--out",
            theirs.to_str().unwrap(),
        ],
        &[],
    );
    assert!(theirs.join("README.md").is_file());
    let aside: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("notes/thesis.tex").is_file())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(
        std::fs::read(aside[0].join("notes/thesis.tex")).unwrap(),
        b"three years of work"
    );
    assert!(
        said.contains(aside[0].to_str().unwrap()),
        "where it went is not said: {said}"
    );
}

/// An export's name is durable: after the rename of its temporary file (or folder) to
/// `--out`, the folder holding it is fsynced (seen in the binary's system calls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_fsyncs_its_folder_after_the_rename() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let (cfg, _mock) = job(&root).await;
    ok(&cfg, &["run", "-q"], &[]);
    let exp = root.join("exp");
    std::fs::create_dir_all(&exp).unwrap();
    for (format, name) in [("sharegpt", "a.jsonl"), ("hf", "hf")] {
        let trace = root.join(format!("trace-{format}"));
        let out = exp.join(name);
        let st = Command::new("strace")
            .args([
                "-f",
                "-qq",
                "-y",
                "-e",
                "trace=rename,renameat,renameat2,fsync,fdatasync",
            ])
            .args(["-e", "status=successful", "-o"])
            .arg(&trace)
            .arg(spool_bin())
            .args(["export", "-q", "--format", format, "--out"])
            .arg(&out)
            .arg("-c")
            .arg(&cfg)
            .status()
            .unwrap();
        assert!(st.success());
        let lines: Vec<String> = std::fs::read_to_string(&trace)
            .unwrap()
            .lines()
            .map(String::from)
            .collect();
        let renamed = lines
            .iter()
            .position(|l| l.contains("rename") && l.contains(&format!("\"{}\"", out.display())))
            .unwrap_or_else(|| panic!("no rename to {}: {lines:#?}", out.display()));
        let synced = lines[renamed..]
            .iter()
            .any(|l| l.contains("sync(") && l.contains(&format!("<{}>)", exp.display())));
        assert!(
            synced,
            "{format}: {} not fsynced after the rename: {lines:#?}",
            exp.display()
        );
    }
}

/// `verify` and a cluster `export` stopped by SIGTERM while they work (every answer of
/// the store delayed 1 s) exit 130 and leave no scratch folder behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_verify_or_export_leaves_no_scratch() {
    use crate::process::Proc;
    use crate::s3::{FaultPlan, FaultProxy, Moto};
    let dir = tempfile::tempdir().unwrap();
    let (cfg, shared) = finished_job(dir.path()).await;
    ok(&cfg, &["finalize"], &[]);
    // The published job, copied into moto, read through a proxy that delays every answer.
    let moto = Moto::start();
    moto.create_bucket("spool-stop");
    let direct = crate::s3::s3_bucket(&moto.endpoint, "s3://spool-stop/job");
    for rel in objects(&shared) {
        direct.upload(&rel, &shared.join(&rel)).await.unwrap();
    }
    let proxy = FaultProxy::start(
        &moto.endpoint,
        FaultPlan {
            every_503: u64::MAX,
            every_reset: u64::MAX,
            every_delay: 1,
            delay: std::time::Duration::from_secs(1),
        },
    )
    .await;
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        &format!("file://{}", shared.display()),
        "s3://spool-stop/job",
    );
    std::fs::write(&cfg, text).unwrap();
    let tmp = dir.path().join("tmp");
    let exp = dir.path().join("exp");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::create_dir_all(&exp).unwrap();
    let out = exp.join("a.jsonl");
    let mut env: Vec<(String, String)> = Moto::env(&proxy.endpoint);
    env.push(("TMPDIR".into(), tmp.display().to_string()));
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    for (args, scratch_in) in [
        (vec!["verify"], &tmp),
        (
            vec![
                "export",
                "--format",
                "sharegpt",
                "--out",
                out.to_str().unwrap(),
            ],
            &exp,
        ),
    ] {
        let mut p = Proc::spawn(&cfg, &args, &env);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::fs::read_dir(scratch_in).unwrap().count() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "no scratch: {}",
                p.stderr()
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        p.signal(libc::SIGTERM);
        let (status, _) = p.wait(std::time::Duration::from_secs(30)).await;
        assert_eq!(status.code(), Some(130), "{args:?}: {}", p.stderr());
        let left: Vec<_> = std::fs::read_dir(scratch_in)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}
