//! Power loss, seen in the real binary's system calls (`strace -f`): every file and folder
//! the queue's records, its next open or the shards rely on has its name made durable — its
//! folder fsynced — before the queue makes durable a record that could name it; and a power
//! cut right after a run, simulated by dropping every name whose folder was never fsynced
//! after it appeared, leaves a queue that opens, verifies clean and holds every prompt once.
//! And a migration stopped midway through the binary's fault point leaves a queue older
//! spools refuse and this one completes.
//!
//! The model is POSIX's: fsyncing a file makes its bytes durable, not its name; a name
//! (created, made by `mkdir`, or renamed to) is durable once its folder is fsynced after it.
//! Needs `strace` (Debian's `strace` package) and ptrace allowed for child processes.

use crate::process::{assert_verify_clean, status_json};
use crate::support::*;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const PROMPTS: usize = 60;

/// The system calls the model needs, successful ones only.
const TRACED: &str = "trace=open,openat,creat,mkdir,mkdirat,rename,renameat,renameat2,\
                      unlink,unlinkat,rmdir,fsync,fdatasync,sync_file_range";

/// One file-system change of the traced run, in the order the kernel completed them.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// A name appeared: a file created, a folder made, or the target of a rename.
    Named { path: PathBuf, by_rename: bool },
    /// A name went away (unlink, rmdir, the source of a rename).
    Unnamed(PathBuf),
    /// `fsync` or `fdatasync` of an open file or folder, or `sync_file_range` (how sled
    /// makes its log durable on Linux).
    Synced(PathBuf),
}

/// A finished, traced run of two datasets of `PROMPTS` prompts each (and one rejected row).
struct Traced {
    /// Kept so the run's folder lives as long as the trace.
    _dir: tempfile::TempDir,
    /// `dir`, canonical (as the kernel names paths in the trace).
    root: PathBuf,
    cfg: PathBuf,
    events: Vec<Event>,
    /// The thread of each event.
    threads: Vec<String>,
    ids: HashMap<&'static str, Vec<String>>,
}

impl Traced {
    fn data(&self) -> PathBuf {
        self.root.join("data")
    }

    /// Names under `data/` and `out/` (those folders included) that exist when the run
    /// ends, each with the index of the event that last named it and whether a rename did.
    fn names_at_end(&self) -> BTreeMap<PathBuf, (usize, bool)> {
        let roots = [self.data(), self.root.join("out")];
        let mut names = BTreeMap::new();
        for (i, e) in self.events.iter().enumerate() {
            match e {
                Event::Named { path, by_rename } if roots.iter().any(|r| path.starts_with(r)) => {
                    names.insert(path.clone(), (i, *by_rename));
                }
                Event::Unnamed(path) => {
                    names.remove(path);
                }
                _ => {}
            }
        }
        names
    }

    /// The first event after `from` that matches.
    fn first_after(&self, from: usize, f: impl Fn(&Event) -> bool) -> Option<usize> {
        (from + 1..self.events.len()).find(|&i| f(&self.events[i]))
    }

    fn synced(&self, at: usize, path: &Path) -> bool {
        self.events[at] == Event::Synced(path.to_path_buf())
    }
}

/// Runs `spool run` twice under strace against the mock, each to the end, and reads both
/// traces as one: first dataset `a` alone (a new queue), then `a` and `b` (the queue
/// reopened — sled renames a snapshot into place — and a new dataset's files added).
async fn traced_run() -> Traced {
    let mock = Mock::start(fast_mock()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut ids = HashMap::new();
    for name in ["a", "b"] {
        let file = dir.path().join(format!("{name}.jsonl"));
        write_prompts(&file, name, PROMPTS);
        ids.insert(name, (0..PROMPTS).map(|i| format!("{name}{i}")).collect());
        if name == "a" {
            // A rejected row: its log is the first file in the dataset's output folder.
            let mut text = std::fs::read_to_string(&file).unwrap();
            text.insert_str(0, "not json\n");
            std::fs::write(&file, text).unwrap();
        }
    }
    let ds = |name| Ds {
        name,
        file: if name == "a" { "a.jsonl" } else { "b.jsonl" },
        budget: None,
    };
    let root = dir.path().canonicalize().unwrap();
    let existing: HashSet<PathBuf> = walk(&root).into_iter().collect();
    let trace_dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    let mut cfg = PathBuf::new();
    for (run, datasets) in [vec![ds("a")], vec![ds("a"), ds("b")]].iter().enumerate() {
        cfg = write_config(&root, &mock.url, "completions", true, datasets, "");
        let trace = trace_dir.path().join(format!("trace-{run}"));
        let mut cmd = Command::new("strace");
        cmd.args(["-f", "-qq", "-y", "-s", "4096", "--seccomp-bpf"])
            .args(["-e", TRACED, "-e", "status=successful", "-o"])
            .arg(&trace)
            .arg(spool_bin())
            .args(["run", "-q", "-c"])
            .arg(&cfg)
            .current_dir(&root);
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("cannot run strace ({e}): install it (Debian: strace)"));
        assert!(
            out.status.success(),
            "spool under strace, run {run}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        text.push_str(&std::fs::read_to_string(&trace).unwrap());
    }
    mock.stop().await;
    let (events, threads) = parse(&text, &root, existing);
    assert!(!events.is_empty(), "empty trace:\n{text}");
    Traced {
        _dir: dir,
        root,
        cfg,
        events,
        threads,
        ids,
    }
}

/// Every path under `dir` (not `dir` itself).
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p);
    }
    out
}

/// The file-system changes of an `strace -f -y` log, in completion order, and the thread
/// that made each. `cwd` resolves
/// relative paths; `existing` are the paths there before the run (an `O_CREAT` open of one
/// of them names nothing new).
fn parse(text: &str, cwd: &Path, existing: HashSet<PathBuf>) -> (Vec<Event>, Vec<String>) {
    let mut exists = existing;
    let mut unfinished: HashMap<&str, String> = HashMap::new();
    let mut events = Vec::new();
    let mut threads = Vec::new();
    for line in text.lines() {
        let Some((pid, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        let call = if let Some(head) = rest.strip_suffix(" <unfinished ...>") {
            unfinished.insert(pid, head.to_string());
            continue;
        } else if let Some(resumed) = rest.strip_prefix("<... ") {
            let (_, tail) = resumed.split_once("resumed>").expect("a resumed call");
            let head = unfinished.remove(pid).expect("a resumed call was started");
            format!("{head}{tail}")
        } else {
            rest.to_string()
        };
        let Some((name, args)) = call.split_once('(') else {
            continue;
        };
        let Some((args, ret)) = args.rsplit_once(" = ") else {
            continue;
        };
        let args = Args::parse(args.trim_end().trim_end_matches(')'), cwd);
        match name {
            "open" | "openat" | "creat" if name == "creat" || args.flags.contains("O_CREAT") => {
                let path = annotated(ret).expect("an opened fd's path");
                if exists.insert(path.clone()) {
                    events.push(Event::Named {
                        path,
                        by_rename: false,
                    });
                }
            }
            "mkdir" | "mkdirat" => {
                exists.insert(args.paths[0].clone());
                events.push(Event::Named {
                    path: args.paths[0].clone(),
                    by_rename: false,
                });
            }
            "rename" | "renameat" | "renameat2" => {
                let (from, to) = (args.paths[0].clone(), args.paths[1].clone());
                exists.remove(&from);
                exists.insert(to.clone());
                events.push(Event::Unnamed(from));
                events.push(Event::Named {
                    path: to,
                    by_rename: true,
                });
            }
            "unlink" | "unlinkat" | "rmdir" => {
                exists.remove(&args.paths[0]);
                events.push(Event::Unnamed(args.paths[0].clone()));
            }
            "fsync" | "fdatasync" | "sync_file_range" => {
                events.push(Event::Synced(args.fds[0].clone()));
            }
            _ => {}
        }
        threads.resize(events.len(), pid.to_string());
    }
    (events, threads)
}

/// A call's arguments as the model needs them: paths (resolved against their directory
/// fd, or the working directory), fds' paths (from `-y`), and the flags.
struct Args {
    paths: Vec<PathBuf>,
    fds: Vec<PathBuf>,
    flags: String,
}

impl Args {
    fn parse(args: &str, cwd: &Path) -> Args {
        let mut a = Args {
            paths: Vec::new(),
            fds: Vec::new(),
            flags: String::new(),
        };
        let mut base = cwd.to_path_buf();
        for arg in args.split(", ") {
            if let Some(s) = arg.strip_prefix('"') {
                let s = s.trim_end_matches('"');
                a.paths.push(base.join(s));
                base = cwd.to_path_buf();
            } else if let Some(p) = annotated(arg) {
                // A directory fd before a path (the *at calls), or an fd argument.
                base = p.clone();
                a.fds.push(p);
            } else {
                a.flags.push_str(arg);
            }
        }
        a
    }
}

/// The path `-y` appends to an fd: `9</tmp/x/data>` → `/tmp/x/data`.
fn annotated(s: &str) -> Option<PathBuf> {
    let (_, rest) = s.split_once('<')?;
    let (path, _) = rest.rsplit_once('>')?;
    Some(PathBuf::from(path.trim_end_matches(" (deleted)")))
}

/// Every name the run left under `data/` and `out/` was durable before the queue could rely
/// on it: its folder was fsynced after the name appeared and before the first flush of the
/// queue (a sync of sled's `db`) that follows the file's first own sync (a block or a
/// result appended, so a record naming it may follow) — for a shard renamed into place,
/// as the renaming thread's next change (the queue records the shard after that); for sled's
/// own files, before any other file is synced (everything else relies on the queue); for a
/// name never synced, by the end of the run. Fails without the folder fsyncs (items/,
/// results/, their files, data_dir, output_dir, sled's folder).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_name_the_queue_relies_on_is_durable_before_the_record_that_names_it() {
    let t = traced_run().await;
    let sled_dir = t.data().join("queue");
    let db = sled_dir.join("db");
    let names = t.names_at_end();
    for want in [
        "items/0.blocks",
        "items/1.blocks",
        "results/0.log",
        "queue/db",
    ] {
        assert!(names.contains_key(&t.data().join(want)), "{want} not named");
    }
    assert!(
        names.iter().any(|(p, (_, by_rename))| *by_rename
            && p.starts_with(&sled_dir)
            && p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("snap.")),
        "the reopened queue renamed no sled snapshot into place"
    );
    let mut late = Vec::new();
    for (path, &(named, by_rename)) in &names {
        let parent = path.parent().unwrap();
        if by_rename && !path.starts_with(&sled_dir) {
            // A shard is renamed into place, its folder fsynced, and only then does the
            // call return to the code that records it: the renaming thread's next change
            // must be that fsync (another thread's flush meanwhile cannot name the shard).
            let next = (named + 1..t.events.len()).find(|&i| t.threads[i] == t.threads[named]);
            if !next.is_some_and(|i| t.synced(i, parent)) {
                late.push(format!(
                    "{} (renamed at event {named}, then {:?} instead of its folder's fsync)",
                    path.display(),
                    next.map(|i| &t.events[i])
                ));
            }
            continue;
        }
        let need = if path.starts_with(&sled_dir) {
            t.first_after(
                named,
                |e| matches!(e, Event::Synced(p) if !p.starts_with(&sled_dir) && !p.is_dir()),
            )
        } else {
            t.first_after(
                named,
                |e| matches!(e, Event::Synced(p) if p.starts_with(path)),
            )
            .and_then(|at| t.first_after(at, |e| *e == Event::Synced(db.clone())))
        }
        .unwrap_or(t.events.len());
        if !(named + 1..need).any(|i| t.synced(i, parent)) {
            late.push(format!(
                "{} (named at event {named}, its folder not fsynced before event {need}: {:?})",
                path.display(),
                t.events.get(need)
            ));
        }
    }
    assert!(
        late.is_empty(),
        "names not durable in time:\n{}",
        late.join("\n")
    );
}

/// A power cut right after a finished run loses every name whose folder was not fsynced
/// after it appeared (the file-system state the model allows); dropping exactly those from
/// the run's folders leaves a queue that opens and verifies clean, every prompt done and
/// in the shards exactly once. Without the folder fsyncs the whole data_dir (or items/,
/// results/) goes, and the queue no longer opens or has lost its items.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_after_a_run_loses_no_name_the_queue_needs() {
    let t = traced_run().await;
    let mut lost: Vec<PathBuf> = t
        .names_at_end()
        .into_iter()
        .filter(|(path, (named, _))| {
            let parent = path.parent().unwrap();
            !(named + 1..t.events.len()).any(|i| t.synced(i, parent))
        })
        .map(|(path, _)| path)
        .collect();
    lost.sort();
    for path in &lost {
        // A name under a folder dropped before it is gone already.
        if path.is_dir() {
            std::fs::remove_dir_all(path).unwrap();
        } else if path.exists() {
            std::fs::remove_file(path).unwrap();
        }
    }
    eprintln!("names a power cut could drop (dropped): {lost:?}");
    assert_verify_clean(&t.cfg);
    let status = status_json(&t.cfg);
    let out = t.root.join("out");
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        assert_eq!(status["datasets"][i]["done"], PROMPTS as u64, "{name}");
        assert_exactly_once(&shard_rows(&out, name), &t.ids[name]);
    }
    assert!(lost.is_empty(), "names a power cut could drop: {lost:?}");
}

/// An interrupted migration through the real binary's fault point: `spool status` on a copy
/// of the format-2 fixture, stopped right after the migration's first batch, fails naming
/// the stop; what any spool reads first from the queue then is `v` = the current format
/// (every older spool refuses a format above its own) and the `V` marker = 2; the next
/// `spool status` resumes and completes the migration, with the fixture's counts intact.
#[test]
fn an_interrupted_migration_is_refused_by_older_spools_and_resumed_by_this_one() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("queue-v2"), &dir.path().join("data"));
    let cfg = dir.path().join("spool.toml");
    std::fs::write(
        &cfg,
        "data_dir = \"data\"\noutput_dir = \"out\"\n[run]\nmetrics_addr = \"\"\n\
         [server]\nurls = [\"http://127.0.0.1:9\"]\nmodel = \"m\"\n\
         [[dataset]]\nname = \"a\"\npath = \"a.jsonl\"\n[[dataset]]\nname = \"b\"\npath = \"b.jsonl\"\n",
    )
    .unwrap();
    let out = crate::process::spool(
        &cfg,
        &["status", "-q"],
        &[("SPOOL_FAULT_QUEUE_MIGRATION_STOP", "1")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("injected stop in the middle of a migration"),
        "{stderr}"
    );
    {
        let db = sled::open(dir.path().join("data/queue")).unwrap();
        let tree = db.open_tree("q").unwrap();
        let read = |k: &[u8]| {
            let v = tree.get(k).unwrap().expect("record present");
            u32::from_be_bytes(v.as_ref().try_into().unwrap())
        };
        assert_eq!(read(b"v"), spool::store::queue::FORMAT_VERSION);
        assert!(read(b"v") > 3, "a format-3 spool would read this queue");
        assert_eq!(read(spool::store::queue::MIGRATING_KEY), 2);
    }
    let j = status_json(&cfg);
    let counts = |i: usize| {
        let d = &j["datasets"][i];
        (
            d["items"].clone(),
            d["done"].clone(),
            d["failed"].clone(),
            d["rejected"].clone(),
        )
    };
    assert_eq!(counts(0), (6.into(), 3.into(), 1.into(), 1.into()));
    assert_eq!(counts(1), (3.into(), 1.into(), 0.into(), 0.into()));
    let db = sled::open(dir.path().join("data/queue")).unwrap();
    let tree = db.open_tree("q").unwrap();
    assert!(tree
        .get(spool::store::queue::MIGRATING_KEY)
        .unwrap()
        .is_none());
    assert_eq!(tree.scan_prefix(b"r").count(), 0, "format-2 results left");
}

/// Copies a folder tree.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}
