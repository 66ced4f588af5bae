//! The job record: a cluster job's shape, fixed once in the store and checked by everyone.
//!
//! `_spool/job/<version>.json`: the partition count, and per dataset the input's content
//! (sha256 and size), its budget, `max_prompts` and the settings that decide what an item
//! of it is (model, API, sampling, generation keys). The first worker creates version 0
//! with a conditional create; every worker compares its config and inputs with the latest
//! version before it touches the store, and `finalize`, `verify` and `status` compare
//! theirs (inputs aside: they do not read them). A difference is [`JobError::Mismatch`]
//! (exit 2) naming both values. `spool run --reshape` writes the next version instead, for
//! the changes that are safe for what is committed: a budget, a higher `max_prompts`, new
//! input (committed items stay committed; new ids are taken in), a new dataset. A new
//! partition count (items would change partitions) or new item settings (a dataset would
//! mix two kinds of generation) are refused even then: that is a new output prefix.
//!
//! Invariants: versions are created with conditional creates, so two reshapes never both
//! win; a reader uses the highest version, checked against its key (its version, a
//! partition count ≥ 1, dataset names), read up to [`commits::RECORD_BYTES`]; anything
//! else under `_spool/job/` is [`JobError::Untrusted`], naming it.

use crate::cluster::commits;
use crate::config::{Config, DatasetConfig};
use crate::output::bucket::{Bucket, BucketError, Created};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// The record's format; a reader refuses a newer one.
pub const FORMAT: u32 = 1;

/// The folder of the job record's versions.
pub const JOB_PREFIX: &str = "_spool/job/";

/// The key of version `v` of the job record.
pub fn job_key(v: u64) -> String {
    format!("{JOB_PREFIX}{v:010}.json")
}

/// The shape of a cluster job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobRecord {
    pub format: u32,
    pub version: u64,
    pub partitions: u32,
    pub datasets: BTreeMap<String, JobDataset>,
    /// The writer (or command) that wrote this version.
    pub writer: String,
    pub created_unix: u64,
    pub spool_version: String,
}

/// One dataset's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobDataset {
    /// The input's bytes: sha256 (hex) and size.
    pub input_sha256: String,
    pub input_bytes: u64,
    pub token_budget: Option<u64>,
    pub max_prompts: Option<u64>,
    /// What an item of the dataset is: model, API, sampling and generation keys.
    pub settings: serde_json::Value,
}

/// A job record that does not match, or cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Bucket(#[from] BucketError),
    #[error("{key}: not a job record this job's workers wrote: {detail}")]
    Untrusted { key: String, detail: String },
    #[error(
        "{key}: job record format {format}, newer than this spool's {FORMAT}; use a newer spool"
    )]
    Newer { key: String, format: u32 },
    /// The config (or an input) is not the job's shape.
    #[error("this config is not the job's shape ({key}): {}; {hint}", .differences.join("; "))]
    Mismatch {
        key: String,
        differences: Vec<String>,
        hint: &'static str,
    },
    /// A change `--reshape` does not make.
    #[error("--reshape cannot make this change ({key}): {}; a new output prefix is a new job", .differences.join("; "))]
    Unsafe {
        key: String,
        differences: Vec<String>,
    },
    /// The store ignores `If-None-Match: *`.
    #[error("{url}: the store does not honour conditional creates (a second create of one key replaced the first): two workers could take one commit number, so spool does not run on it; use a store that supports `If-None-Match: *` on PUT (AWS S3, MinIO, recent Ceph RGW, R2) or a local folder")]
    NoConditionalCreates { url: String },
    /// The count is unknown (no config, no record).
    #[error("{url}: no job record (no worker has started on this output) and no partition count in the config; set [run] partitions or pass --partitions")]
    NoCount { url: String },
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

fn untrusted(key: &str, detail: impl Into<String>) -> JobError {
    JobError::Untrusted {
        key: key.into(),
        detail: detail.into(),
    }
}

/// The version of `key` when it names a version of the job record.
fn version_of(key: &str) -> Option<u64> {
    let digits = key.strip_prefix(JOB_PREFIX)?.strip_suffix(".json")?;
    (digits.len() == 10 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The latest version of the job record, or `None` when there is none.
pub async fn read_latest(bucket: &Bucket) -> Result<Option<JobRecord>, JobError> {
    let mut latest = None;
    for (key, _) in bucket.list(JOB_PREFIX).await? {
        match version_of(&key) {
            Some(v) => latest = latest.max(Some(v)),
            None => {
                return Err(untrusted(
                    &key,
                    "not a version of the job record (they are named _spool/job/NNNNNNNNNN.json)",
                ))
            }
        }
    }
    let Some(v) = latest else {
        return Ok(None);
    };
    read_version(bucket, v).await.map(Some)
}

async fn read_version(bucket: &Bucket, v: u64) -> Result<JobRecord, JobError> {
    let key = job_key(v);
    let Some(body) = bucket.get_capped(&key, commits::RECORD_BYTES).await? else {
        return Err(untrusted(&key, "listed, then gone"));
    };
    parse(&key, &body, v)
}

/// Parses version `v` read from `key`, refusing one that is not what a worker writes.
pub fn parse(key: &str, body: &[u8], v: u64) -> Result<JobRecord, JobError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| untrusted(key, format!("not JSON: {e}")))?;
    let format = value.get("format").and_then(|f| f.as_u64()).unwrap_or(0);
    if format > u64::from(FORMAT) {
        return Err(JobError::Newer {
            key: key.into(),
            format: format.min(u64::from(u32::MAX)) as u32,
        });
    }
    let r: JobRecord = serde_json::from_value(value)
        .map_err(|e| untrusted(key, format!("not a job record: {e}")))?;
    if r.version != v {
        return Err(untrusted(
            key,
            format!("it says version {}, but is filed as version {v}", r.version),
        ));
    }
    if r.partitions == 0 {
        return Err(untrusted(key, "partitions = 0"));
    }
    if let Some(name) = r.datasets.keys().find(|n| !commits::is_dataset_name(n)) {
        return Err(untrusted(
            key,
            format!("dataset {name:?} is not a dataset name"),
        ));
    }
    if !crate::config::valid_name(&r.writer) {
        return Err(untrusted(
            key,
            format!("writer {:?} is not a writer id", r.writer),
        ));
    }
    Ok(r)
}

/// The settings that decide what an item of dataset `d` is.
pub fn settings_of(cfg: &Config, d: &DatasetConfig) -> serde_json::Value {
    let g = cfg.generation_of(d);
    serde_json::json!({
        "api": cfg.server.api,
        "model": cfg.server.model,
        "sampling": cfg.sampling_of(d),
        "reasoning": g.reasoning,
        "turns": g.turns,
        "history_reasoning": g.history_reasoning,
        "samples": g.samples,
        "chat_template_kwargs": g.chat_template_kwargs,
    })
}

/// The shape `cfg` describes with `partitions`, and each dataset's input (sha256, size).
pub fn shape_of(
    cfg: &Config,
    partitions: u32,
    inputs: &BTreeMap<String, (String, u64)>,
    writer: &str,
) -> JobRecord {
    JobRecord {
        format: FORMAT,
        version: 0,
        partitions,
        datasets: cfg
            .datasets
            .iter()
            .map(|d| {
                let (sha, bytes) = inputs.get(&d.name).cloned().unwrap_or_default();
                (
                    d.name.clone(),
                    JobDataset {
                        input_sha256: sha,
                        input_bytes: bytes,
                        token_budget: d.token_budget,
                        max_prompts: d.max_prompts,
                        settings: settings_of(cfg, d),
                    },
                )
            })
            .collect(),
        writer: writer.into(),
        created_unix: now_unix(),
        spool_version: env!("CARGO_PKG_VERSION").to_string(),
    }
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One way a config differs from the record: what, the record's value, the config's, and
/// whether `--reshape` may make the change.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    pub what: String,
    pub recorded: String,
    pub here: String,
    pub safe: bool,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: the job record says {}, this one {}",
            self.what, self.recorded, self.here
        )
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or("none".into(), |v| v.to_string())
}

/// How `here` differs from `recorded`; inputs are compared only when `inputs` (workers).
pub fn differences(recorded: &JobRecord, here: &JobRecord, inputs: bool) -> Vec<Difference> {
    let mut out = Vec::new();
    if recorded.partitions != here.partitions {
        out.push(Difference {
            what: "partitions".into(),
            recorded: recorded.partitions.to_string(),
            here: here.partitions.to_string(),
            safe: false,
        });
    }
    for (name, r) in &recorded.datasets {
        let Some(h) = here.datasets.get(name) else {
            out.push(Difference {
                what: format!("dataset `{name}`"),
                recorded: "it".into(),
                here: "has no such dataset".into(),
                safe: false,
            });
            continue;
        };
        if inputs && (r.input_sha256 != h.input_sha256 || r.input_bytes != h.input_bytes) {
            out.push(Difference {
                what: format!("dataset `{name}` input"),
                recorded: format!("sha256 {} ({} bytes)", r.input_sha256, r.input_bytes),
                here: format!("sha256 {} ({} bytes)", h.input_sha256, h.input_bytes),
                safe: true,
            });
        }
        if r.token_budget != h.token_budget {
            out.push(Difference {
                what: format!("dataset `{name}` token_budget"),
                recorded: opt(r.token_budget),
                here: opt(h.token_budget),
                safe: true,
            });
        }
        if r.max_prompts != h.max_prompts {
            // Items already taken in stay: only a higher cap (or none) is safe.
            let safe = match (r.max_prompts, h.max_prompts) {
                (Some(a), Some(b)) => b >= a,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (None, None) => true,
            };
            out.push(Difference {
                what: format!("dataset `{name}` max_prompts"),
                recorded: opt(r.max_prompts),
                here: opt(h.max_prompts),
                safe,
            });
        }
        if let Some((path, a, b)) = first_difference(&r.settings, &h.settings, String::new()) {
            out.push(Difference {
                what: format!("dataset `{name}` {path}"),
                recorded: a,
                here: b,
                safe: false,
            });
        }
    }
    for name in here.datasets.keys() {
        if !recorded.datasets.contains_key(name) {
            out.push(Difference {
                what: format!("dataset `{name}`"),
                recorded: "no such dataset".into(),
                here: "adds it".into(),
                safe: true,
            });
        }
    }
    out
}

/// The first leaf where two JSON values differ: its path and both values.
fn first_difference(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: String,
) -> Option<(String, String, String)> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    p,
                )
            })
        }
        _ if a == b => None,
        _ => Some((
            if path.is_empty() {
                "settings".into()
            } else {
                path
            },
            a.to_string(),
            b.to_string(),
        )),
    }
}

/// Refuses with [`JobError::Mismatch`] when `here` differs from `recorded`.
pub fn refuse_differences(
    recorded: &JobRecord,
    here: &JobRecord,
    inputs: bool,
    hint: &'static str,
) -> Result<(), JobError> {
    let d = differences(recorded, here, inputs);
    if d.is_empty() {
        return Ok(());
    }
    Err(JobError::Mismatch {
        key: job_key(recorded.version),
        differences: d.iter().map(ToString::to_string).collect(),
        hint,
    })
}

/// What a worker found: the record it runs under, and whether it wrote it.
#[derive(Debug)]
pub enum Established {
    /// The latest version matched.
    Matched(JobRecord),
    /// This worker created version 0.
    Created(JobRecord),
    /// This worker wrote a new version (`--reshape`): the differences it made.
    Reshaped(JobRecord, Vec<Difference>),
}

impl Established {
    /// The record the job runs under now.
    pub fn record(&self) -> &JobRecord {
        match self {
            Established::Matched(r) | Established::Created(r) | Established::Reshaped(r, _) => r,
        }
    }
}

/// The hint of a worker's mismatch.
const WORKER_HINT: &str = "run it with the job's config and inputs, give it a new output_dir, or `spool run --reshape` for a change that is safe (README, Running on a cluster)";

/// Refuses `here` against the latest record before a worker reads or writes anything
/// else: any difference without `reshape`, a difference `--reshape` does not make with it.
pub async fn precheck(bucket: &Bucket, here: &JobRecord, reshape: bool) -> Result<(), JobError> {
    let Some(r) = read_latest(bucket).await? else {
        return Ok(());
    };
    refuse_unless_reshaped(&r, &differences(&r, here, true), reshape)
}

/// Refuses `d`, the differences from record `r`: all of them without `reshape`, those
/// `--reshape` does not make with it.
fn refuse_unless_reshaped(r: &JobRecord, d: &[Difference], reshape: bool) -> Result<(), JobError> {
    if d.is_empty() {
        return Ok(());
    }
    if !reshape {
        return Err(JobError::Mismatch {
            key: job_key(r.version),
            differences: d.iter().map(ToString::to_string).collect(),
            hint: WORKER_HINT,
        });
    }
    let unsafe_: Vec<String> = d
        .iter()
        .filter(|d| !d.safe)
        .map(ToString::to_string)
        .collect();
    if unsafe_.is_empty() {
        Ok(())
    } else {
        Err(JobError::Unsafe {
            key: job_key(r.version),
            differences: unsafe_,
        })
    }
}

/// Reads the job record and settles it with the worker's shape `here`: creates version 0
/// when there is none; refuses a difference unless `reshape`, which writes the next
/// version when every difference is safe. Conditional creates: a lost race reads the
/// winner's version and compares again.
pub async fn establish(
    bucket: &Bucket,
    here: &JobRecord,
    reshape: bool,
) -> Result<Established, JobError> {
    loop {
        let latest = read_latest(bucket).await?;
        let (version, diffs) = match &latest {
            None => (0, Vec::new()),
            Some(r) => {
                let d = differences(r, here, true);
                if d.is_empty() {
                    return Ok(Established::Matched(r.clone()));
                }
                refuse_unless_reshaped(r, &d, reshape)?;
                (r.version + 1, d)
            }
        };
        let mut record = here.clone();
        record.version = version;
        let body = serde_json::to_vec_pretty(&record).unwrap_or_default();
        match bucket.create(&job_key(version), body.into()).await? {
            Created::Mine if latest.is_none() => return Ok(Established::Created(record)),
            Created::Mine => return Ok(Established::Reshaped(record, diffs)),
            // Someone wrote this version first: compare with theirs.
            Created::Theirs(_) => continue,
        }
    }
}

/// The sha256 and size of a dataset's input file, kept in `cache` (by path, size and
/// modification time) so an unchanged file is not read again at the next start.
pub fn fingerprint(path: &Path, cache: &Path) -> Result<(String, u64), JobError> {
    let io = |source| JobError::Io {
        path: path.into(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let stamp = format!("{}|{}|{mtime}", path.display(), meta.len());
    type Cached = BTreeMap<String, (String, u64)>;
    let mut cached: Cached = std::fs::read(cache)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    if let Some(hit) = cached.get(&stamp) {
        return Ok(hit.clone());
    }
    let mut h = Sha256::new();
    let n = std::io::copy(&mut std::fs::File::open(path).map_err(io)?, &mut h).map_err(io)?;
    let got = (crate::config::hex(&h.finalize()), n);
    cached.retain(|k, _| !k.starts_with(&format!("{}|", path.display())));
    cached.insert(stamp, got.clone());
    // Only a cache: a failed write costs a read at the next start.
    let _ = serde_json::to_vec(&cached).map(|b| std::fs::write(cache, b));
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::bucket::BucketOptions;

    fn record(partitions: u32, budget: Option<u64>, temperature: f64) -> JobRecord {
        let mut datasets = BTreeMap::new();
        datasets.insert(
            "d".to_string(),
            JobDataset {
                input_sha256: "ab".repeat(32),
                input_bytes: 10,
                token_budget: budget,
                max_prompts: Some(5),
                settings: serde_json::json!({"sampling": {"temperature": temperature}}),
            },
        );
        JobRecord {
            format: FORMAT,
            version: 0,
            partitions,
            datasets,
            writer: "w".into(),
            created_unix: 0,
            spool_version: "0".into(),
        }
    }

    /// The first worker creates the record; the same shape matches; another partition
    /// count is refused naming both counts, with or without `--reshape`; a new budget is
    /// refused without it and written as version 1 with it; new item settings are
    /// refused even with it, naming the key and both values.
    #[test]
    fn the_shape_is_fixed_once_and_changed_only_where_safe() {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let b = Bucket::open("memory://", &BucketOptions::default()).unwrap();
                let two = record(2, Some(100), 0.7);
                assert!(matches!(
                    establish(&b, &two, false).await.unwrap(),
                    Established::Created(_)
                ));
                assert!(matches!(
                    establish(&b, &two, false).await.unwrap(),
                    Established::Matched(_)
                ));
                let three = record(3, Some(100), 0.7);
                for reshape in [false, true] {
                    let e = establish(&b, &three, reshape)
                        .await
                        .unwrap_err()
                        .to_string();
                    assert!(
                        e.contains("partitions: the job record says 2, this one 3"),
                        "{e}"
                    );
                }
                let more = record(2, Some(200), 0.7);
                let e = establish(&b, &more, false).await.unwrap_err().to_string();
                assert!(
                    e.contains("token_budget: the job record says 100, this one 200"),
                    "{e}"
                );
                match establish(&b, &more, true).await.unwrap() {
                    Established::Reshaped(r, d) => {
                        assert_eq!(r.version, 1);
                        assert_eq!(d.len(), 1);
                    }
                    other => panic!("{other:?}"),
                }
                assert_eq!(read_latest(&b).await.unwrap().unwrap().version, 1);
                let hotter = record(2, Some(200), 1.0);
                let e = establish(&b, &hotter, true).await.unwrap_err().to_string();
                assert!(
                    e.contains("sampling.temperature: the job record says 0.7, this one 1.0"),
                    "{e}"
                );
                // A stray object among the versions, and a version filed under another
                // number, are refused by name.
                b.put("_spool/job/x.json", "{}".into()).await.unwrap();
                let e = read_latest(&b).await.unwrap_err().to_string();
                assert!(e.contains("_spool/job/x.json"), "{e}");
                b.delete("_spool/job/x.json").await.unwrap();
                let body = serde_json::to_vec(&record(2, None, 0.7)).unwrap();
                b.put(&job_key(2), body.into()).await.unwrap();
                let e = read_latest(&b).await.unwrap_err().to_string();
                assert!(e.contains(&job_key(2)) && e.contains("version 0"), "{e}");
            });
    }
}
