//! Stage 2, prompt: a row becomes the text and token ids the server is sent, rendered by
//! the model's own chat template and tokenizer as HuggingFace would.
//!
//! Invariant: the prompt ids are those `transformers` would produce for the same row (for
//! Kimi, those of its vendor tokenizer as the server calls it); the goldens under
//! `tests/fixtures` and the Python oracles of the tests pin it.
//!
//! The modules, in the order a row meets them: [`builder`] turns a row into a
//! [`BuiltPrompt`]; [`chat_template`] renders `messages` rows, with [`python`] giving
//! template values Python's printing and `json.dumps`; [`tokenizer`] encodes the text
//! ([`model_folder`] says which file of a model folder it is), with [`byte_bpe`] as its
//! exact fast path for byte-level BPE files, whose pre-tokenizer split is [`pretokenize`],
//! and [`tiktoken`] for Kimi's vocabulary, whose split is [`kimi_pattern`]; both merge
//! with `merge`; [`remote`] names what a server that renders prompts itself does;
//! [`settings`] checks the config's prompt keys against this stage; [`end_of_turn`] is the
//! token a model's files say closes a turn;
//! [`error`] is the stage's one error type.

pub mod builder;
pub mod byte_bpe;
pub mod chat_template;
pub mod conversation;
pub mod draw;
pub mod end_of_turn;
pub mod error;
pub mod kimi_pattern;
pub mod kimi_tools;
mod merge;
pub mod model_folder;
pub mod pretokenize;
pub(crate) mod python;
pub mod reasoning;
pub mod remote;
pub mod settings;
pub mod syntax;
pub mod tiktoken;
pub mod tokenizer;
pub mod tool_text;

pub use builder::{BuiltPrompt, PromptBuilder};
pub use chat_template::ChatTemplate;
pub use error::TemplateError;
pub use tokenizer::Tokenizer;

/// Lower-case hex sha256 of a file's bytes, recorded in shard metadata so outputs say which
/// template and tokenizer made them.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    crate::config::hex(&Sha256::digest(bytes))
}
