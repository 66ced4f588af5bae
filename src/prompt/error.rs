//! The prompt stage's one error type.
//!
//! Invariant: every error names the file it comes from (template, config or tokenizer), and
//! a template's own `raise_exception` is its own variant, so a caller can reject just the
//! row that triggered it.

use std::fmt;
use std::path::{Path, PathBuf};

/// Why a template or tokenizer could not be loaded or applied.
///
/// `Load` and `NoTemplate` are configuration errors (the run cannot start); the others
/// concern one row's content, see [`TemplateError::is_row_error`].
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A template or tokenizer file could not be read, parsed or compiled.
    #[error("cannot load {}: {detail}", path.display())]
    Load {
        /// The file that failed.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// Rendering failed (a Jinja error: bad operation, undefined attribute, bad input).
    #[error("chat template {}: {detail}", template.display())]
    Render {
        /// The template file.
        template: PathBuf,
        /// The Jinja error, with its line in the template.
        detail: String,
    },
    /// The template refused the messages through `raise_exception(message)`.
    #[error("chat template {} rejected the messages: {message}", template.display())]
    Raised {
        /// The template file.
        template: PathBuf,
        /// The template's own message (such as "Conversation roles must alternate").
        message: String,
    },
    /// The tokenizer failed to encode or decode (the detail names the tokenizer file).
    #[error("tokenizer: {detail}")]
    Tokenize {
        /// What went wrong, starting with the tokenizer file.
        detail: String,
    },
    /// A `messages` row needs a chat template and none is configured.
    #[error("a `messages` row needs a chat template, and none is configured: set `[tokenizer] chat_template` (or a model folder as `[tokenizer] path`), or `[server] api = \"chat\"` to have the server render it")]
    NoTemplate,
}

impl TemplateError {
    /// True when the error is about one row's content (reject the row, go on), false when
    /// it is about the configuration (stop).
    pub fn is_row_error(&self) -> bool {
        matches!(
            self,
            Self::Render { .. } | Self::Raised { .. } | Self::Tokenize { .. }
        )
    }
}

/// A [`TemplateError::Load`] naming `path`.
pub(super) fn load_error(path: &Path, detail: impl fmt::Display) -> TemplateError {
    TemplateError::Load {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}
