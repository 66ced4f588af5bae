//! The token that closes an assistant turn as a model's own files say it: the
//! `eos_token` of the `tokenizer_config.json` beside its tokenizer, looked up in that
//! tokenizer. Exports append it to turns the server left it out of; the mock server ends
//! its answers with it.
//!
//! Invariant: a token the tokenizer does not have is an error naming the file and the
//! key, never a guessed id; no file or no key is `None`.

use crate::prompt::tokenizer::Tokenizer;
use std::path::Path;

/// The token that closes an assistant turn, and where spool learned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOfTurn {
    pub id: u32,
    pub token: String,
    /// The model family's turn close, `generation_config.json`'s `eos_token_id`,
    /// `tokenizer_config.json`'s `eos_token`, or `--end-of-turn`.
    pub source: String,
    /// The (id, token) that closes a turn ending in tool calls, where the family has
    /// another one (GLM's `<|observation|>`, gpt-oss's `<|call|>`).
    pub after_tool_call: Option<(u32, String)>,
}

/// The end-of-turn token of the tokenizer at `tokenizer_json`: `eos_token` of the
/// `tokenizer_config.json` beside it, looked up in the tokenizer. None when there is no
/// such file or key; the error names the file and the key.
pub fn end_of_turn_of(
    tokenizer_json: &Path,
    tokenizer: &Tokenizer,
) -> Result<Option<EndOfTurn>, String> {
    let cfg = tokenizer_json.with_file_name("tokenizer_config.json");
    let text = match std::fs::read_to_string(&cfg) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", cfg.display())),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", cfg.display()))?;
    let token = match &v["eos_token"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => match o.get("content") {
            Some(serde_json::Value::String(s)) => s.clone(),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let id = tokenizer.token_to_id(&token).ok_or_else(|| {
        format!(
            "{}: key `eos_token`: `{token}` is not a token of {}",
            cfg.display(),
            tokenizer_json.display()
        )
    })?;
    Ok(Some(EndOfTurn {
        id,
        token,
        source: format!("{} (eos_token)", cfg.display()),
        after_tool_call: None,
    }))
}
