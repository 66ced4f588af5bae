//! The Python wheel as an ML engineer gets it: `make wheel` (maturin, `bindings = "bin"`)
//! builds it, pip installs it offline into a fresh venv, and the `spool` it puts on PATH
//! runs a real job against its own mock server.
//!
//! maturin always builds through cargo (it cannot pack a binary built before), and this
//! test build's `spool` has fault injection, which a user's must not; so the wheel is built
//! with the dev profile (a release build would compile every dependency again) on top of
//! this test build: cargo's build dir is this build's target dir, so its compiled
//! dependencies are reused and only what differs (spool without fault injection) is
//! compiled, once; the binary lands in a temp target dir, so the suite's own
//! `target/debug/spool` is never replaced under running tests.

use crate::support::{assert_exactly_once, qwen_table, shard_rows, spool_bin, write_chats};
use crate::support::{write_config, Ds};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A child process killed when the test ends, passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `program` must be on PATH: it is what `make test` installs (.venv/, tests/requirements.txt).
fn require(program: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "the wheel test needs `{program}` on PATH: `make test` installs it into .venv/ from \
         tests/requirements.txt (or `pip install -r tests/requirements.txt`)"
    );
}

/// Runs `c` to the end; it must exit 0.
fn ok(c: &mut Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Where this test build's intermediates are: cargo's build dir when one is set, else the
/// target dir the `spool` under test was built in (`<target>/debug/spool`).
fn build_dir() -> PathBuf {
    match std::env::var_os("CARGO_BUILD_BUILD_DIR") {
        Some(d) => PathBuf::from(d),
        None => spool_bin()
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf(),
    }
}

/// `make wheel` writes one `spool_llm-<version>-py3-none-manylinux_*` wheel (the crate's
/// version; Python-independent; the portable Linux tag, so pip takes it on other distros);
/// `pip install --no-index` puts `spool` into a fresh venv's bin/, byte for byte the binary
/// cargo built from the crate's `[[bin]]`, and without fault injection (`--version` says
/// so); the installed metadata carries the PyPI name, the licence and Cargo's description.
/// That `spool`, found on PATH, starts its mock server on a free loopback port, runs a
/// chat dataset through the Qwen3 tokenizer and template to the end, and `status`,
/// `verify` and the shards agree: every row exactly once, with prompt and completion ids.
#[test]
fn wheel_installs_spool_on_path_and_runs_a_job() {
    require("maturin");
    require("python3");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let dist = tmp.path().join("dist");
    let target = tmp.path().join("target");

    let mut make = Command::new("make");
    make.args(["-s", "-C"])
        .arg(repo)
        .arg("wheel")
        .arg("WHEEL_PROFILE=dev")
        .arg(format!("WHEEL_OUT={}", dist.display()));
    // The environment `cargo nextest run` (or `cargo test`) was started in, without what it
    // set for this test: build scripts that track a variable such as CARGO_MANIFEST_DIR
    // would otherwise run again, and everything above them be compiled again, in both
    // builds in turn. Nor the jobserver of a `make test` around this test.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        let set_for_tests = ["CARGO_PKG_", "CARGO_BIN_", "CARGO_MANIFEST_", "NEXTEST"]
            .iter()
            .any(|p| k.starts_with(p))
            || [
                "CARGO",
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
            ]
            .contains(&k.as_ref());
        if set_for_tests || ["MAKEFLAGS", "MFLAGS", "MAKELEVEL"].contains(&k.as_ref()) {
            make.env_remove(k.as_ref());
        }
    }
    ok(make
        .env("CARGO_TARGET_DIR", &target)
        .env("CARGO_BUILD_BUILD_DIR", build_dir()));
    let wheels: Vec<PathBuf> = std::fs::read_dir(&dist)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(wheels.len(), 1, "{wheels:?}");
    let name = wheels[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let arch = std::env::consts::ARCH;
    assert!(
        name.starts_with(&format!("spool_llm-{VERSION}-py3-none-manylinux_"))
            && name.ends_with(&format!("_{arch}.whl")),
        "{name}"
    );

    let venv = tmp.path().join("venv");
    ok(Command::new("python3").arg("-m").arg("venv").arg(&venv));
    ok(Command::new(venv.join("bin/python3"))
        .args(["-m", "pip", "install", "--quiet", "--no-index"])
        .arg("--disable-pip-version-check")
        .arg(&wheels[0]));
    let installed = venv.join("bin/spool");
    assert!(
        std::fs::read(&installed).unwrap() == std::fs::read(target.join("debug/spool")).unwrap(),
        "the installed spool is not the binary cargo built"
    );
    let meta = ok(Command::new(venv.join("bin/python3")).args([
        "-c",
        "import importlib.metadata as m; d = m.metadata('spool-llm'); \
         print(d['Name'], d['Version'], d['License-Expression'], sep='\\n'); print(d['Summary'])",
    ]));
    assert_eq!(
        String::from_utf8_lossy(&meta.stdout),
        format!(
            "spool-llm\n{VERSION}\nApache-2.0\n{}\n",
            env!("CARGO_PKG_DESCRIPTION")
        )
    );

    // From here on, `spool` is whatever PATH finds first: the venv's, as once activated.
    let path = std::env::join_paths(
        std::iter::once(venv.join("bin"))
            .chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let spool = |args: &[&str]| {
        let mut c = Command::new("spool");
        c.args(args).env("PATH", &path).current_dir(tmp.path());
        c
    };
    let version = ok(&mut spool(&["--version"]));
    let version = String::from_utf8_lossy(&version.stdout);
    assert!(
        version.starts_with(&format!("spool {VERSION} ")) && version.contains("injection off"),
        "{version}"
    );

    let tokenizer = crate::support::fixtures().join("tokenizers/qwen3/tokenizer.json");
    let mut mock = Killed(
        spool(&[
            "mock-server",
            "--addr",
            "127.0.0.1:0",
            "--time-scale",
            "100",
        ])
        .args(["--mean-tokens", "40", "--seed", "5", "--tokenizer"])
        .arg(&tokenizer)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(mock.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("mock-server printed {line:?}"))
        .to_string();

    let dir = tmp.path();
    write_chats(&dir.join("c.jsonl"), "c", 24);
    let cfg = write_config(
        dir,
        &url,
        "chat",
        true,
        &[Ds {
            name: "chat",
            file: "c.jsonl",
            budget: None,
        }],
        &qwen_table(),
    );
    let cfg = cfg.to_str().unwrap();
    ok(&mut spool(&["run", "-q", "-c", cfg]));
    let status = ok(&mut spool(&["status", "-c", cfg]));
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("chat ") && l.contains("24/24") && l.ends_with("done")),
        "{status}"
    );
    let verify = ok(&mut spool(&["verify", "-c", cfg]));
    let verify = String::from_utf8_lossy(&verify.stdout);
    assert!(verify.contains("verify: clean"), "{verify}");

    let rows = shard_rows(&dir.join("out"), "chat");
    assert_exactly_once(&rows, &(0..24).map(|i| format!("c{i}")).collect::<Vec<_>>());
    for r in &rows {
        assert!(
            !r.completion.is_empty()
                && r.completion_token_ids
                    .as_ref()
                    .is_some_and(|t| !t.is_empty())
                && r.prompt_token_ids.as_ref().is_some_and(|t| !t.is_empty()),
            "{r:?}"
        );
    }
}
