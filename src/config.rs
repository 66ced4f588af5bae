//! `spool.toml`: the user's description of a job (docs/configuration.md documents every
//! key).
//!
//! Invariants: every key is known (serde `deny_unknown_fields`), so a typo is an error naming
//! the key and the file, never a silently ignored setting; every relative path is resolved
//! against the config file's directory at load time, so nothing later depends on the cwd;
//! dataset names are safe folder names (`[A-Za-z0-9_.-]+`, not `.` or `..`) and unique;
//! every server URL is `http://` or `https://` with a host, written in the characters RFC
//! 3986 allows (nothing is percent-encoded on the user's behalf, so the URL that is logged
//! is the URL that is requested), without user info, query or fragment; an API key is
//! header-safe. `Config` imports nothing above `knobs` and `secrets`: the checks that need
//! the prompt stage or the CA file's certificates are made by a run before it writes
//! anything (`prompt::settings`, `upstream::tls::trust_roots`).
//!
//! A loaded `Config` is the file with the command line's [`Overrides`] (a worker's
//! partition index in `data_dir` too) applied before validation, and read-only from then
//! on: what a run learns later (its partition, a staging folder, fetched inputs, a
//! partition's budgets) is its plan (`run::plan::JobPlan`), never written back here
//! (`tests/it/code_rules.rs` checks).
//!
//! The tables are `server` (`[server]`, `[run]`), `tokenizer`, `dataset` (`[[dataset]]`,
//! `[sampling]` and the generation keys) and `storage` (`[shards]`); `validate` holds the
//! checks `load` runs.

mod dataset;
pub mod partition;
mod server;
mod storage;
mod tokenizer;
mod validate;

pub use dataset::{
    Choice, DatasetConfig, GenerationSpec, HistoryReasoning, OnLength, PromptFormat, Reasoning,
    Sampling, SamplingOverride, Turns, MAX_SAMPLES,
};
pub use server::{Api, BudgetPolicy, Concurrency, Routing, RunConfig, ServerConfig};
pub use storage::{BucketOptions, ShardConfig};
pub use tokenizer::{PromptSource, TemplateCheck, TokenizerConfig};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use validate::byte_kind;

/// A config that cannot be used; the message names the file and the key (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bad config {path}: {detail}")]
    Parse { path: PathBuf, detail: String },
    #[error("bad config {path}: key `{key}`: {detail}")]
    Invalid {
        path: PathBuf,
        key: String,
        detail: String,
    },
}

/// The whole job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    #[serde(default = "default_output_dir")]
    pub output_dir: PathBuf,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub tokenizer: Option<TokenizerConfig>,
    #[serde(default)]
    pub sampling: Sampling,
    #[serde(default)]
    pub shards: ShardConfig,
    /// Object-store settings beyond the `AWS_*` environment (an `s3://` output or input).
    #[serde(default)]
    pub storage: BucketOptions,
    #[serde(default, rename = "dataset")]
    pub datasets: Vec<DatasetConfig>,
    /// Defaults for every dataset's generation keys (each `[[dataset]]` may override).
    /// Spelled out here and there rather than `#[serde(flatten)]`ed: flattening loses the
    /// line of an unknown key in the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<Turns>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_reasoning: Option<HistoryReasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    /// Template variables; a table of integer weights is drawn from per row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_length: Option<OnLength>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_format: Option<PromptFormat>,
    /// Where this config was read from (not a key).
    #[serde(skip)]
    pub source: PathBuf,
    /// sha256 of the config file's bytes, stamped into every shard.
    #[serde(skip)]
    pub sha256: String,
}

fn default_data_dir() -> PathBuf {
    "spool-data".into()
}
fn default_output_dir() -> PathBuf {
    "spool-out".into()
}

/// Command-line settings that win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub data_dir: Option<PathBuf>,
    pub output_dir: Option<PathBuf>,
    pub concurrency: Option<Concurrency>,
    pub metrics_addr: Option<String>,
    /// Replaces `[server] urls` (a Slurm task's own server port).
    pub server_urls: Vec<String>,
    /// This worker's partition index, which replaces `{partition}` in `data_dir` (the
    /// partition itself is the run's plan: `run::plan`).
    pub partition: Option<u32>,
}

impl Config {
    /// Reads, validates and resolves a config file; CLI overrides are applied last.
    pub fn load(path: &Path, overrides: &Overrides) -> Result<Config, ConfigError> {
        let bytes = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let text = String::from_utf8(bytes.clone()).map_err(|_| ConfigError::Parse {
            path: path.to_path_buf(),
            detail: "not UTF-8".into(),
        })?;
        let mut cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            detail: e.to_string().trim_end().to_string(),
        })?;
        cfg.source = path.to_path_buf();
        cfg.sha256 = hex(&Sha256::digest(&bytes));
        let base = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        cfg.apply(overrides);
        cfg.resolve(&base);
        if let Some(i) = overrides.partition {
            let dir = cfg
                .data_dir
                .to_string_lossy()
                .replace("{partition}", &i.to_string());
            cfg.data_dir = PathBuf::from(dir);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    fn apply(&mut self, o: &Overrides) {
        if let Some(d) = &o.data_dir {
            self.data_dir = d.clone();
        }
        if let Some(d) = &o.output_dir {
            self.output_dir = d.clone();
        }
        if let Some(c) = o.concurrency {
            self.run.concurrency = c;
        }
        if let Some(a) = &o.metrics_addr {
            self.run.metrics_addr = a.clone();
        }
        if !o.server_urls.is_empty() {
            self.server.urls = o.server_urls.clone();
        }
    }

    fn resolve(&mut self, base: &Path) {
        let join = |p: &PathBuf| {
            // A `scheme://` location (object storage) is not a path.
            if p.is_absolute() || p.to_string_lossy().contains("://") {
                p.clone()
            } else {
                base.join(p)
            }
        };
        self.data_dir = join(&self.data_dir);
        self.output_dir = join(&self.output_dir);
        self.server.ca_cert = self.server.ca_cert.as_ref().map(join);
        if let Some(t) = &mut self.tokenizer {
            t.path = join(&t.path);
            t.chat_template = t.chat_template.as_ref().map(join);
        }
        for d in &mut self.datasets {
            d.path = join(&d.path);
        }
    }

    /// An error naming this config's file and `key` (exit code 2), also for what is only
    /// found out at start-up (a server's certificate refused).
    pub fn invalid(&self, key: &str, detail: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            path: self.source.clone(),
            key: key.into(),
            detail: detail.into(),
        }
    }

    /// The API key from the environment, if configured. Never logged. A key that cannot
    /// go into an `Authorization` header as is (a space, a control character such as a
    /// trailing newline, non-ASCII) is refused here rather than rejected by every request.
    pub fn api_key(&self) -> Result<Option<String>, ConfigError> {
        match &self.server.api_key_env {
            None => Ok(None),
            Some(var) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => match v.bytes().position(|b| !(0x21..0x7f).contains(&b)) {
                    None => Ok(Some(v)),
                    Some(at) => Err(self.invalid(
                        "server.api_key_env",
                        format!(
                            "the key in `{var}` has a character that cannot be sent in an HTTP header \
                             (byte {at} of {}: {}); only visible ASCII is allowed",
                            v.len(),
                            byte_kind(v.as_bytes()[at])
                        ),
                    )),
                },
                _ => Err(self.invalid(
                    "server.api_key_env",
                    format!("environment variable `{var}` is not set"),
                )),
            },
        }
    }
}

/// Whether a dataset name is usable as a folder name under `output_dir`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-')
}

/// Lower-case hex of bytes (digests in metadata and logs).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("spool.toml");
        std::fs::write(&p, text).unwrap();
        Config::load(&p, &Overrides::default())
    }

    /// A misspelt key is an error naming the key and the file, not a setting silently ignored.
    #[test]
    fn unknown_key_is_named() {
        let e = load_str("[run]\nconcurency = 3\n[[dataset]]\nname='a'\npath='a.jsonl'\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("concurency"), "{e}");
        assert!(e.contains("spool.toml"), "{e}");
    }

    /// A typo in the generation keys (a misspelt key, an unknown value) is refused with
    /// its line; bad values are refused naming the dataset and the key; good ones load,
    /// the top level giving defaults.
    #[test]
    fn generation_keys_are_checked() {
        let base =
            "[server]\nurls = ['http://127.0.0.1:1']\n[[dataset]]\nname='a'\npath='a.jsonl'\n";
        for (extra, says) in [
            ("turn = 'all'\n", "line 6"),
            ("turns = 'every'\n", "line 6"),
            ("reasoning = 'hide'\n", "line 6"),
            ("history_reasoning = 'kept'\n", "line 6"),
        ] {
            let e = load_str(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(e.contains(says), "{extra}: {e}");
        }
        for (extra, key) in [
            ("samples = 0\n", "dataset[0].samples"),
            ("samples = 1025\n", "dataset[0].samples"),
        ] {
            let e = load_str(&format!("{base}{extra}")).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("dataset `a`"), "{extra}: {e}");
        }
        let e = load_str(&format!(
            "{base}[dataset.sampling]\ntemperature = {{ \"0.6\" = -1 }}\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("line 7") && e.contains("positive integer"),
            "{e}"
        );
        let cfg = load_str(&format!(
            "samples = 4\nchat_template_kwargs = {{ effort = {{ low = 4, high = 2 }} }}\n{base}\
             turns = 'all'\n[dataset.sampling]\ntemperature = [0.6, 1.0]\n"
        ))
        .unwrap();
        let g = cfg.generation_of(&cfg.datasets[0]);
        assert_eq!((g.samples, g.turns), (4, Turns::All));
        assert!(g.chat_template_kwargs.contains_key("effort"));
        assert_eq!(cfg.sampling_of(&cfg.datasets[0]).temperature, 0.6);
    }

    /// `[tokenizer] source` and `template_check` read as documented: the check defaults to
    /// stopping with spool's rendering and to a warning with the server's; a bad value is
    /// refused naming the key's line.
    #[test]
    fn tokenizer_source_and_template_check_keys() {
        let base = "[[dataset]]\nname='a'\npath='a.jsonl'\n[tokenizer]\npath='t.json'\n";
        let t = |extra: &str| load_str(&format!("{base}{extra}")).map(|c| c.tokenizer.unwrap());
        let plain = t("").unwrap();
        assert_eq!(plain.source, PromptSource::Client);
        assert_eq!(plain.template_check(), TemplateCheck::Stop);
        let server = t("source = 'server'\n").unwrap();
        assert_eq!(server.template_check(), TemplateCheck::Warn);
        for (v, want) in [
            ("true", TemplateCheck::Stop),
            ("false", TemplateCheck::Off),
            ("'warn'", TemplateCheck::Warn),
        ] {
            let c = t(&format!("source = 'server'\ntemplate_check = {v}\n")).unwrap();
            assert_eq!(c.template_check(), want, "{v}");
        }
        for bad in ["template_check = 'stop'\n", "source = 'both'\n"] {
            let e = t(bad).unwrap_err().to_string();
            assert!(e.contains("line 6"), "{bad}: {e}");
        }
    }

    /// Dataset names that would escape or collide as folder names are refused, naming the key.
    #[test]
    fn bad_dataset_names_are_refused() {
        for n in ["../x", "a/b", "..", ".", ""] {
            let e = load_str(&format!("[[dataset]]\nname='{n}'\npath='a.jsonl'\n")).unwrap_err();
            assert!(e.to_string().contains("dataset[0].name"), "{e}");
        }
    }

    /// Relative paths resolve against the config file's folder, a dataset's sampling
    /// overrides the global one key by key, and the config's hash is recorded.
    #[test]
    fn relative_paths_resolve_against_the_config_and_overrides_apply() {
        let c = load_str(
            "data_dir='d'\n[sampling]\nmax_tokens=100\n[[dataset]]\nname='a'\npath='p/a.jsonl'\n[dataset.sampling]\ntemperature=0.1\n",
        )
        .unwrap();
        assert!(c.data_dir.is_absolute() && c.data_dir.ends_with("d"));
        assert!(c.datasets[0].path.ends_with("p/a.jsonl"));
        let s = c.sampling_of(&c.datasets[0]);
        assert_eq!((s.max_tokens, s.temperature), (100, 0.1));
        assert_eq!(c.sha256.len(), 64);
    }
}
