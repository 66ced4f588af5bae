//! Prompts rendered by the inference server instead of by spool (`[tokenizer] source =
//! "server"`, and the start-up `template_check`): what a row asks to be rendered, who
//! rendered a prompt's ids, and the stage's view of a server that renders.
//!
//! The renderer itself speaks HTTP and lives in `upstream::render`; this stage only names
//! what it does, so intake and the workers depend on the trait, not on the client.
//!
//! Invariant: an input is rendered by the server exactly as spool would render it —
//! the same messages, the same template variables (the row's `tools` among them), a
//! generation prompt added; a plain prompt with special tokens unless its text already
//! starts with them ([`RenderInput::text`]).

use futures_util::future::BoxFuture;
use serde_json::{Map, Value};

use super::{BuiltPrompt, PromptBuilder, TemplateError};

/// Where a prompt's token ids came from: the shard column `prompt_ids_source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdsSource {
    /// spool's own template and tokenizer.
    Client,
    /// The server: its rendering endpoint, or the prompt ids of its chat answer.
    Server,
}

impl IdsSource {
    /// The column's value.
    pub fn as_str(self) -> &'static str {
        match self {
            IdsSource::Client => "client",
            IdsSource::Server => "server",
        }
    }

    /// Reads the column's value back; `None` for anything else.
    pub fn parse(s: &str) -> Option<IdsSource> {
        match s {
            "client" => Some(IdsSource::Client),
            "server" => Some(IdsSource::Server),
            _ => None,
        }
    }
}

/// What one prompt is made of before anyone renders it.
#[derive(Debug, Clone, PartialEq)]
pub enum RenderInput {
    /// A `prompt` row: its text, tokenized with special tokens when `add_special`.
    Text { text: String, add_special: bool },
    /// Chat messages and the template variables they are rendered with (`tools` among
    /// them when the row offers tools).
    Chat {
        messages: Value,
        kwargs: Map<String, Value>,
    },
}

impl RenderInput {
    /// A plain prompt as `builder` would encode it: special tokens added unless the text
    /// already starts with them (no second BOS, see
    /// [`super::Tokenizer::encode_prompt`]).
    pub fn text(builder: &PromptBuilder, text: &str) -> RenderInput {
        let prefix = builder.tokenizer().map_or("", |t| t.special_prefix());
        RenderInput::Text {
            text: text.to_owned(),
            add_special: prefix.is_empty() || !text.starts_with(prefix),
        }
    }

    /// Renders the input with spool's own template and tokenizer.
    pub fn build(&self, builder: &PromptBuilder) -> Result<BuiltPrompt, TemplateError> {
        match self {
            RenderInput::Text { text, .. } => builder.build_text(text),
            RenderInput::Chat { messages, kwargs } => builder.build_chat_with(messages, kwargs),
        }
    }

    /// Whether the input is chat messages (which only some servers render).
    pub fn is_chat(&self) -> bool {
        matches!(self, RenderInput::Chat { .. })
    }
}

/// Why the server did not render an input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    /// The server refused this input (its template failed, a bad message): the row's
    /// fault, the same on every attempt.
    #[error("{0}")]
    Refused(String),
    /// No server answered after the retries (down, overloaded, a broken answer): says
    /// nothing about the row.
    #[error("{0}")]
    Unavailable(String),
}

/// A server that renders prompts; implemented over HTTP by `upstream::render`.
pub trait RemoteRenderer: std::fmt::Debug + Send + Sync {
    /// Renders one input: the server's text and ids.
    fn render<'a>(
        &'a self,
        input: &'a RenderInput,
    ) -> BoxFuture<'a, Result<BuiltPrompt, RemoteError>>;

    /// Renders `inputs` in order, several at a time, blocking the calling thread (an
    /// intake worker, never a runtime thread).
    fn render_blocking(&self, inputs: &[RenderInput]) -> Vec<Result<BuiltPrompt, RemoteError>>;

    /// Where the server renders, for messages: such as `POST http://h:8000/tokenize`.
    fn describe(&self) -> String;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The column's values read back as written, and nothing else reads.
    #[test]
    fn ids_sources_round_trip() {
        for s in [IdsSource::Client, IdsSource::Server] {
            assert_eq!(IdsSource::parse(s.as_str()), Some(s));
        }
        assert_eq!(IdsSource::parse("Server"), None);
    }

    /// A plain prompt gets special tokens unless it already starts with them; without a
    /// tokenizer there is no prefix to repeat.
    #[test]
    fn plain_prompts_get_special_tokens_once() {
        let none = PromptBuilder::new(None, None);
        assert_eq!(
            RenderInput::text(&none, "<s>hi"),
            RenderInput::Text {
                text: "<s>hi".into(),
                add_special: true
            }
        );
    }
}
