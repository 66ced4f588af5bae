//! Test and benchmark switches: fault points that land a failure where a kill harness needs
//! one, and benchmark switches that turn an optimisation off so its gain can be measured on
//! one binary.
//!
//! Invariant: the environment is read here and only here, once, by the CLI layer
//! ([`Knobs::from_env`]); modules get the values passed down, so a library caller (a test
//! running a job in-process) decides them itself and `Knobs::default()` is a plain run.
//! Invariant: the fault points are read from the environment only by builds made for
//! tests (the `fault-injection` feature, which the test suite turns on through its
//! dev-dependency on this crate); any other build leaves them off whatever is set, warns
//! once when one is set, and says so in `--version` ([`VERSION`]).

use std::time::Duration;

/// Env var: pause (ms) inside shard finalisation, before and after the rename.
pub const FAULT_SHARD_PAUSE: &str = "SPOOL_FAULT_SHARD_PAUSE_MS";
/// Env var: pause (ms) between a cluster worker's shard upload and its commit record.
pub const FAULT_PUBLISH_PAUSE: &str = "SPOOL_FAULT_PUBLISH_PAUSE_MS";
/// Env var: `1` makes shard writes fail as on a full disk.
pub const FAULT_SHARD_WRITE_ERROR: &str = "SPOOL_FAULT_SHARD_WRITE_ERROR";
/// Env var: after a failed commit the committer waits this many ms before reporting it, as
/// a descheduled task would.
pub const FAULT_COMMIT_FAILED_PAUSE: &str = "SPOOL_FAULT_COMMIT_FAILED_PAUSE_MS";
/// Env var: `N` makes the Nth request attempt panic inside its task, `N-M` the Nth to the
/// Mth (counted from 1 in the order attempts start).
pub const FAULT_PANIC_IN_REQUEST: &str = "SPOOL_FAULT_PANIC_IN_REQUEST";
/// Env var: `N` (or `N-M`) makes building the Nth completed answer's row panic.
pub const FAULT_PANIC_IN_ROW: &str = "SPOOL_FAULT_PANIC_IN_ROW";
/// Env var: the Nth commit that completes an item is torn as by a full disk.
pub const FAULT_QUEUE_TORN_COMMIT: &str = "SPOOL_FAULT_QUEUE_TORN_COMMIT";
/// Env var: a migration stops with an error after its Nth durable batch.
pub const FAULT_QUEUE_MIGRATION_STOP: &str = "SPOOL_FAULT_QUEUE_MIGRATION_STOP";
/// Env var: how often (ms) "no inference server reachable" is repeated; tests shorten it.
pub const DOWN_LOG_INTERVAL: &str = "SPOOL_DOWN_LOG_INTERVAL_MS";
/// Every fault-point variable.
pub const FAULT_VARS: [&str; 8] = [
    FAULT_SHARD_PAUSE,
    FAULT_PUBLISH_PAUSE,
    FAULT_SHARD_WRITE_ERROR,
    FAULT_COMMIT_FAILED_PAUSE,
    FAULT_PANIC_IN_REQUEST,
    FAULT_PANIC_IN_ROW,
    FAULT_QUEUE_TORN_COMMIT,
    FAULT_QUEUE_MIGRATION_STOP,
];

/// Whether this build obeys the `SPOOL_FAULT_*` variables: only a build made for tests.
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

/// What `spool --version` says: the version, and whether fault injection is obeyed.
pub const VERSION: &str = if FAULT_INJECTION {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (test build: obeys SPOOL_FAULT_* fault injection)"
    )
} else {
    concat!(
        env!("CARGO_PKG_VERSION"),
        " (SPOOL_FAULT_* fault injection off: not a test build)"
    )
};

/// Env var (benchmarks): set, the NFC bypass of the tokenizer is off.
pub const BENCH_NO_NFC_BYPASS: &str = "SPOOL_BENCH_NO_NFC_BYPASS";
/// Env var (benchmarks): set, the fast byte-level BPE encoder is off.
pub const BENCH_NO_FAST_BPE: &str = "SPOOL_BENCH_NO_FAST_BPE";
/// Env var (benchmarks): set, budgets are gated naively (the comparison baseline).
pub const BENCH_NAIVE_BUDGET: &str = "SPOOL_BENCH_NAIVE_BUDGET";
/// Env var (benchmarks): set, datasets are served one after another.
pub const BENCH_SERIAL_DATASETS: &str = "SPOOL_BENCH_SERIAL_DATASETS";

/// Every switch, read once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Knobs {
    /// Fault points (tests only).
    pub faults: Faults,
    /// Benchmark switches.
    pub bench: Bench,
    /// How often the "every server down" line is repeated (a minute unless a test shortens it).
    pub down_log_interval: Duration,
}

/// Fault points; all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    pub shard_pause: Option<Duration>,
    /// A cluster worker pauses this long between a shard's upload and its commit record,
    /// so a kill can land there.
    pub publish_pause: Option<Duration>,
    pub shard_write_error: bool,
    pub commit_failed_pause: Option<Duration>,
    /// Inclusive range of request attempts (from 1) that panic.
    pub panic_in_request: Option<(u64, u64)>,
    /// Inclusive range of answered rows (from 1) whose building panics.
    pub panic_in_row: Option<(u64, u64)>,
    /// The commit (from 1) that is torn; `None`: none.
    pub queue_torn_commit: Option<u64>,
    /// The migration batch (from 1) after which the migration stops; `None`: none.
    pub queue_migration_stop: Option<u64>,
}

/// Benchmark switches; all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bench {
    pub no_nfc_bypass: bool,
    pub no_fast_bpe: bool,
    pub naive_budget: bool,
    pub serial_datasets: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            faults: Faults::default(),
            bench: Bench::default(),
            down_log_interval: Duration::from_secs(60),
        }
    }
}

impl Knobs {
    /// The switches set in this process's environment; fault points only in a build made
    /// for tests (else one warning names the variables ignored).
    pub fn from_env() -> Knobs {
        let (knobs, ignored) = Knobs::from_build(|name| std::env::var(name).ok(), FAULT_INJECTION);
        if !ignored.is_empty() {
            tracing::warn!(variables = ?ignored,
                "fault-injection variables ignored: this is not a test build (see `spool --version`)");
        }
        knobs
    }

    /// The switches as `lookup` gives them, the fault points only when `faults_obeyed`;
    /// also the fault variables that were set but ignored.
    pub fn from_build(
        lookup: impl Fn(&str) -> Option<String>,
        faults_obeyed: bool,
    ) -> (Knobs, Vec<&'static str>) {
        let mut knobs = Knobs::from_lookup(&lookup);
        let mut ignored = Vec::new();
        if !faults_obeyed {
            knobs.faults = Faults::default();
            ignored = FAULT_VARS
                .into_iter()
                .filter(|v| lookup(v).is_some())
                .collect();
        }
        (knobs, ignored)
    }

    /// The switches as `lookup` gives them, fault points included (a library caller or a
    /// test decides); unparsable values leave a switch off.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Knobs {
        let millis = |name| {
            lookup(name)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_millis)
        };
        let count = |name| {
            lookup(name)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|&n| n >= 1)
        };
        let set = |name| lookup(name).is_some();
        Knobs {
            faults: Faults {
                shard_pause: millis(FAULT_SHARD_PAUSE),
                publish_pause: millis(FAULT_PUBLISH_PAUSE),
                shard_write_error: lookup(FAULT_SHARD_WRITE_ERROR).is_some_and(|v| v.trim() == "1"),
                commit_failed_pause: millis(FAULT_COMMIT_FAILED_PAUSE),
                panic_in_request: lookup(FAULT_PANIC_IN_REQUEST).and_then(|v| range(&v)),
                panic_in_row: lookup(FAULT_PANIC_IN_ROW).and_then(|v| range(&v)),
                queue_torn_commit: count(FAULT_QUEUE_TORN_COMMIT),
                queue_migration_stop: count(FAULT_QUEUE_MIGRATION_STOP),
            },
            bench: Bench {
                no_nfc_bypass: set(BENCH_NO_NFC_BYPASS),
                no_fast_bpe: set(BENCH_NO_FAST_BPE),
                naive_budget: set(BENCH_NAIVE_BUDGET),
                serial_datasets: set(BENCH_SERIAL_DATASETS),
            },
            down_log_interval: millis(DOWN_LOG_INTERVAL).unwrap_or(Duration::from_secs(60)),
        }
    }
}

/// `N` → (N, N); `N-M` → (N, M); anything else: off.
fn range(v: &str) -> Option<(u64, u64)> {
    let v = v.trim();
    let (a, b) = v.split_once('-').unwrap_or((v, v));
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a >= 1 && a <= b).then_some((a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each switch is read from its own variable, and garbage leaves it off.
    #[test]
    fn switches_are_read_from_their_variables() {
        let env = |name: &str| {
            Some(
                match name {
                    FAULT_SHARD_PAUSE => "250",
                    FAULT_SHARD_WRITE_ERROR => "1",
                    FAULT_PANIC_IN_REQUEST => "3-5",
                    FAULT_PANIC_IN_ROW => "x",
                    FAULT_QUEUE_TORN_COMMIT => "0",
                    FAULT_QUEUE_MIGRATION_STOP => "2",
                    DOWN_LOG_INTERVAL => "100",
                    BENCH_NAIVE_BUDGET => "",
                    _ => return None,
                }
                .to_string(),
            )
        };
        let k = Knobs::from_lookup(env);
        assert_eq!(k.faults.shard_pause, Some(Duration::from_millis(250)));
        assert!(k.faults.shard_write_error);
        assert_eq!(k.faults.panic_in_request, Some((3, 5)));
        assert_eq!(k.faults.panic_in_row, None);
        assert_eq!(k.faults.queue_torn_commit, None);
        assert_eq!(k.faults.queue_migration_stop, Some(2));
        assert_eq!(k.down_log_interval, Duration::from_millis(100));
        assert!(k.bench.naive_budget && !k.bench.serial_datasets);
        assert_eq!(Knobs::from_lookup(|_| None), Knobs::default());
    }

    /// A build not made for tests leaves every fault point off whatever is set, keeps the
    /// other switches, and names the fault variables it ignored; a test build obeys them.
    #[test]
    fn only_a_test_build_obeys_fault_variables() {
        let env = |name: &str| {
            (FAULT_VARS.contains(&name) || name == BENCH_NAIVE_BUDGET || name == DOWN_LOG_INTERVAL)
                .then(|| "1".to_string())
        };
        let (release, ignored) = Knobs::from_build(env, false);
        assert_eq!(release.faults, Faults::default());
        assert!(release.bench.naive_budget);
        assert_eq!(release.down_log_interval, Duration::from_millis(1));
        assert_eq!(ignored, FAULT_VARS.to_vec());
        let (test, ignored) = Knobs::from_build(env, true);
        assert!(test.faults.shard_write_error && test.faults.queue_torn_commit == Some(1));
        assert!(ignored.is_empty());
        assert!(Knobs::from_build(|_| None, false).1.is_empty());
        // The suite runs as a test build, and says so.
        const {
            assert!(
                FAULT_INJECTION,
                "the test suite must build with `fault-injection`"
            )
        };
        assert!(VERSION.contains("test build"));
    }
}
