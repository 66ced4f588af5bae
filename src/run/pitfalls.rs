//! Settings that run without an error yet do not do what a user means, found from the
//! config and the prompt tools before anything is requested, and warned about once each:
//! `chat_template_kwargs` keys the template never reads, and rows that will carry no token
//! ids (which the id exports need). The self-check's own warnings are in `probe`.
//!
//! Invariant: nothing here stops a run; each warning names the key to change.

use crate::config::{Api, Config};
use crate::prompt::PromptBuilder;

/// `chat_template_kwargs` keys the servers' chat APIs read themselves: SGLang's and vLLM's
/// reasoning parsers decide from them whether an answer has thinking to split off.
const SERVER_READS: &[&str] = &["enable_thinking", "thinking"];

/// Per dataset, the `chat_template_kwargs` keys that spool's chat template never reads
/// (sorted), where any; nothing without a template (what the server's reads is unknown).
pub fn unread_kwargs(cfg: &Config, builder: &PromptBuilder) -> Vec<(String, Vec<String>)> {
    let Some(template) = builder.template() else {
        return Vec::new();
    };
    let reads = template.reads();
    let chat = cfg.server.api == Api::Chat;
    cfg.datasets
        .iter()
        .filter_map(|d| {
            let mut keys: Vec<String> = cfg
                .generation_of(d)
                .chat_template_kwargs
                .keys()
                .filter(|k| {
                    let server_reads = chat && SERVER_READS.contains(&k.as_str());
                    !reads.contains(*k) && !server_reads
                })
                .cloned()
                .collect();
            keys.sort();
            (!keys.is_empty()).then(|| (d.name.clone(), keys))
        })
        .collect()
}

/// The key whose absence leaves rows without spool's token ids: `[tokenizer]`, or with
/// `api = "chat"` a chat template to render the messages spool encodes.
pub fn missing_for_ids(cfg: &Config, builder: &PromptBuilder) -> Option<&'static str> {
    if !builder.has_tokenizer() {
        return Some("[tokenizer]");
    }
    (cfg.server.api == Api::Chat && !builder.has_template()).then_some("[tokenizer] chat_template")
}

/// Logs the warnings of `cfg` with its prompt tools.
pub fn warn(cfg: &Config, builder: &PromptBuilder) {
    for (dataset, keys) in unread_kwargs(cfg, builder) {
        let template = builder
            .template()
            .map(|t| t.origin().display().to_string())
            .unwrap_or_default();
        tracing::warn!(dataset = %dataset, keys = %keys.join(", "), template = %template,
            "chat_template_kwargs keys the chat template never reads: they change nothing");
    }
    match missing_for_ids(cfg, builder) {
        Some("[tokenizer]") => tracing::warn!(
            "no [tokenizer]: rows get no prompt token ids from spool, and the id exports need them (tokens, specforge, speculators); set [tokenizer] path"
        ),
        Some(key) => tracing::warn!(
            "api = \"chat\" without a chat template: spool cannot render the messages to make prompt token ids (rows keep the server's where it returns them), and the id exports need them; set {key}"
        ),
        None => {}
    }
}
