"""Where cargo puts spool's builds: the target folder as `cargo metadata` reports it, so the
benchmarks find the binary with CARGO_TARGET_DIR (or a cargo config's build.target-dir)
set, not only under ./target."""
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def target_dir():
    """The folder cargo builds this package into."""
    out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return pathlib.Path(json.loads(out)["target_directory"])


def release_bin():
    """The release binary that `cargo build --release` makes."""
    return target_dir() / "release" / "spool"
