//! A model folder as it is downloaded (the Hugging Face layout): which file is the
//! tokenizer, and where the tokenizer config, chat template and generation config are.
//!
//! Invariants:
//! - One place decides: `tokenizer.json` if the folder has one, else `tiktoken.model`
//!   (with its `tokenizer_config.json`); the chat template is `chat_template.jinja`, else
//!   `tokenizer_config.json` when it has a `chat_template`.
//! - A path to a file is that tokenizer file, and its folder holds the others.
//! - A folder with neither tokenizer file is an error naming the folder and what was
//!   looked for.

use std::path::{Path, PathBuf};

use super::error::{load_error, TemplateError};

/// `tokenizer.json`, HuggingFace `tokenizers`' file.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// `tiktoken.model`, a tiktoken vocabulary (Kimi's).
pub const TIKTOKEN_MODEL: &str = "tiktoken.model";
/// `tokenizer_config.json`: special tokens, and often the chat template.
pub const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// `chat_template.jinja`: the chat template, where a model ships it on its own.
pub const CHAT_TEMPLATE: &str = "chat_template.jinja";
/// `generation_config.json`: the model's generation defaults (its end-of-turn ids).
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// Which kind of tokenizer file a model has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerFile {
    /// A HuggingFace `tokenizer.json`.
    Json(PathBuf),
    /// A tiktoken vocabulary, built with the `tokenizer_config.json` beside it.
    Tiktoken(PathBuf),
}

impl TokenizerFile {
    /// The file itself.
    pub fn path(&self) -> &Path {
        match self {
            Self::Json(p) | Self::Tiktoken(p) => p,
        }
    }
}

/// The files of one model that spool reads.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// The folder.
    pub dir: PathBuf,
    pub tokenizer: TokenizerFile,
    /// `tokenizer_config.json`, if the folder has one.
    pub tokenizer_config: Option<PathBuf>,
    /// `chat_template.jinja`, else `tokenizer_config.json` if it has a `chat_template`.
    pub chat_template: Option<PathBuf>,
    /// `generation_config.json`, if the folder has one.
    pub generation_config: Option<PathBuf>,
}

fn file_in(dir: &Path, name: &str) -> Option<PathBuf> {
    let p = dir.join(name);
    p.is_file().then_some(p)
}

/// Whether a `tokenizer_config.json` has a chat template (unreadable: no; the template
/// loader names the problem if it is asked to read it).
fn has_chat_template(config: &Path) -> bool {
    std::fs::read(config)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| v.get("chat_template").is_some_and(|t| !t.is_null()))
}

impl ModelFiles {
    /// The files of the model at `path`: a model folder, or a tokenizer file
    /// (`tokenizer.json`, or a tiktoken vocabulary named `*.model` / `*.tiktoken`) whose
    /// folder holds the rest.
    pub fn locate(path: &Path) -> Result<Self, TemplateError> {
        let (dir, tokenizer) = if path.is_dir() {
            let tokenizer = if let Some(p) = file_in(path, TOKENIZER_JSON) {
                TokenizerFile::Json(p)
            } else if let Some(p) = file_in(path, TIKTOKEN_MODEL) {
                TokenizerFile::Tiktoken(p)
            } else {
                return Err(load_error(
                    path,
                    format!(
                        "a model folder needs `{TOKENIZER_JSON}`, or `{TIKTOKEN_MODEL}` with \
                         `{TOKENIZER_CONFIG}`; this folder has neither tokenizer file"
                    ),
                ));
            };
            (path.to_path_buf(), tokenizer)
        } else {
            let tiktoken = path
                .extension()
                .is_some_and(|e| e == "model" || e == "tiktoken");
            let file = path.to_path_buf();
            let dir = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            let tokenizer = if tiktoken {
                TokenizerFile::Tiktoken(file)
            } else {
                TokenizerFile::Json(file)
            };
            (dir, tokenizer)
        };
        let tokenizer_config = file_in(&dir, TOKENIZER_CONFIG);
        let chat_template = file_in(&dir, CHAT_TEMPLATE)
            .or_else(|| tokenizer_config.clone().filter(|c| has_chat_template(c)));
        Ok(Self {
            generation_config: file_in(&dir, GENERATION_CONFIG),
            dir,
            tokenizer,
            tokenizer_config,
            chat_template,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers")
    }

    /// The Kimi folder is a tiktoken model with its config, whose chat template is in
    /// `tokenizer_config.json`; the Qwen3 folder is `tokenizer.json`; a file path is that
    /// file; `chat_template.jinja` wins over the config's template.
    #[test]
    fn folders_and_files_are_located() {
        let kimi = ModelFiles::locate(&fixtures().join("kimi-k2")).unwrap();
        assert_eq!(
            kimi.tokenizer,
            TokenizerFile::Tiktoken(fixtures().join("kimi-k2/tiktoken.model"))
        );
        let config = fixtures().join("kimi-k2/tokenizer_config.json");
        assert_eq!(kimi.tokenizer_config.as_deref(), Some(config.as_path()));
        assert_eq!(kimi.chat_template.as_deref(), Some(config.as_path()));
        let qwen = ModelFiles::locate(&fixtures().join("qwen3")).unwrap();
        assert_eq!(
            qwen.tokenizer,
            TokenizerFile::Json(fixtures().join("qwen3/tokenizer.json"))
        );
        let file = ModelFiles::locate(&fixtures().join("kimi-k2/tiktoken.model")).unwrap();
        assert_eq!(file.dir, fixtures().join("kimi-k2"));
        assert!(matches!(file.tokenizer, TokenizerFile::Tiktoken(_)));

        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            fixtures().join("qwen3/tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
        let bare = ModelFiles::locate(dir.path()).unwrap();
        assert_eq!(bare.chat_template, None, "a config without a template");
        assert_eq!(bare.generation_config, None);
        std::fs::write(dir.path().join("chat_template.jinja"), "{{ 1 }}").unwrap();
        std::fs::write(dir.path().join("generation_config.json"), "{}").unwrap();
        let with = ModelFiles::locate(dir.path()).unwrap();
        assert_eq!(
            with.chat_template,
            Some(dir.path().join("chat_template.jinja"))
        );
        assert_eq!(
            with.generation_config,
            Some(dir.path().join("generation_config.json"))
        );
    }

    /// A folder with no tokenizer file says so, naming the folder and both files.
    #[test]
    fn a_folder_without_a_tokenizer_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "{}").unwrap();
        let err = ModelFiles::locate(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(
            err.contains("tokenizer.json") && err.contains("tiktoken.model"),
            "{err}"
        );
        assert!(!err.contains("Is a directory"), "{err}");
    }
}
