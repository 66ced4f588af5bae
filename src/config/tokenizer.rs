//! The `[tokenizer]` table: client-side tokenization and chat templating, who renders
//! prompts, and the start-up template check.
//!
//! Invariant: an unknown key is refused; `template_check` absent means stop where spool
//! renders and warn where the server does.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Client-side tokenization and chat templating.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
    /// SGLang's `--reasoning-parser` name, in place of the one the template implies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_parser: Option<String>,
    /// SGLang's `--tool-call-parser` name, in place of the one the template implies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_parser: Option<String>,
    /// Who renders prompts into ids: spool (`client`), or the server's own rendering
    /// endpoint (`server`), for models whose rendering spool does not reproduce.
    #[serde(default)]
    pub source: PromptSource,
    /// The start-up comparison of spool's rendering with the server's; absent: on where a
    /// server renders (a warning only with `source = "server"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_check: Option<TemplateCheck>,
}

/// Who renders prompts into the ids that are sent and stored (`[tokenizer] source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptSource {
    /// spool's template and tokenizer, on every core at intake.
    #[default]
    Client,
    /// The server's rendering endpoint (vLLM `/tokenize`, llama.cpp `/apply-template`).
    Server,
}

/// What a difference found by the start-up template check does (`true`, `"warn"`,
/// `false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value", into = "serde_json::Value")]
pub enum TemplateCheck {
    /// Stops the run (exit 2) before any generation.
    Stop,
    /// Logs the difference and goes on.
    Warn,
    /// No check.
    Off,
}

impl TryFrom<serde_json::Value> for TemplateCheck {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        match v {
            serde_json::Value::Bool(true) => Ok(TemplateCheck::Stop),
            serde_json::Value::Bool(false) => Ok(TemplateCheck::Off),
            serde_json::Value::String(s) if s == "warn" => Ok(TemplateCheck::Warn),
            other => Err(format!("expected true, false or \"warn\", not {other}")),
        }
    }
}

impl From<TemplateCheck> for serde_json::Value {
    fn from(c: TemplateCheck) -> serde_json::Value {
        match c {
            TemplateCheck::Stop => true.into(),
            TemplateCheck::Warn => "warn".into(),
            TemplateCheck::Off => false.into(),
        }
    }
}

impl TokenizerConfig {
    /// The check as configured, else its default: stop with spool's rendering, warn with
    /// the server's (spool's rendering is then sent nowhere).
    pub fn template_check(&self) -> TemplateCheck {
        self.template_check.unwrap_or(match self.source {
            PromptSource::Client => TemplateCheck::Stop,
            PromptSource::Server => TemplateCheck::Warn,
        })
    }
}
