//! The model's tokenizer: the ids sent to the server and the counts budgets use.
//!
//! Two backends behind one API: a HuggingFace `tokenizer.json`, and Kimi's tiktoken
//! vocabulary ([`super::tiktoken`]). [`Tokenizer::from_file`] takes either file or the
//! model folder holding it ([`super::model_folder`] decides which).
//!
//! Invariants:
//! - Ids are those of `tokenizers` for the same file and text; the two shortcuts (the NFC
//!   bypass and the fast byte-level BPE encoder) are taken only where they give the same
//!   ids, and each can be turned off ([`crate::knobs::Bench`]) to measure it. A tiktoken
//!   vocabulary gives the ids of its vendor's tokenizer as the server calls it.
//! - A tokenizer never truncates or pads, whatever `tokenizer.json` says: budgets and
//!   length checks need the true counts.
//! - Plain prompts never get a double BOS: [`Tokenizer::encode_prompt`] adds special
//!   tokens unless the text already starts with the text of those it would prepend.
//! - Errors name the tokenizer file; a tokenizer is `Send + Sync` and cheap to clone.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value as JsonValue;

use super::byte_bpe::ByteBpe;
use super::error::{load_error, TemplateError};
use super::model_folder::{ModelFiles, TokenizerFile, TOKENIZER_CONFIG};
use super::sha256_hex;
use super::tiktoken::{names_vendor_class, BadVocabulary, TiktokenBpe, VENDOR_CLASS};
use crate::knobs::Bench;

/// The model's tokenizer (a HuggingFace `tokenizer.json` or Kimi's tiktoken
/// vocabulary), giving the ids sent to the server and the token counts budgets rely on.
/// Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    backend: Backend,
    sha256: Arc<str>,
    origin: Arc<Path>,
    /// Text of the tokens `encode(_, true)` puts before the text (e.g. `<s>`); empty
    /// when the post-processor adds none.
    prefix_text: Arc<str>,
}

#[derive(Clone)]
enum Backend {
    Hf(Hf),
    Tiktoken(Arc<TiktokenBpe>),
}

/// A `tokenizer.json` and its shortcuts.
#[derive(Clone)]
struct Hf {
    inner: Arc<tokenizers::Tokenizer>,
    /// The same tokenizer without its normaliser, when that normaliser is exactly NFC.
    /// Text that is already NFC is its own normal form, so this gives the same ids while
    /// skipping the per-character alignment bookkeeping.
    nfc_bypass: Option<Arc<tokenizers::Tokenizer>>,
    /// The exact fast encoder, when `tokenizer.json` is a byte-level BPE of the
    /// GPT-4/Qwen2 shape (see [`crate::prompt::byte_bpe`]); text it cannot take (not NFC under an
    /// NFC normaliser) still goes through `tokenizers`.
    fast: Option<Arc<ByteBpe>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("sha256", &self.sha256)
            .field("prefix_text", &self.prefix_text)
            .finish()
    }
}

impl Tokenizer {
    /// Loads the tokenizer at `path` (a `tokenizer.json`, a tiktoken vocabulary, or the
    /// model folder holding one) with every shortcut on; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        Self::from_file_with(path, &Bench::default())
    }

    /// [`Tokenizer::from_file`], with the shortcuts `bench` turns off left off, so a
    /// benchmark can measure each on one binary; errors name the file.
    pub fn from_file_with(path: &Path, bench: &Bench) -> Result<Self, TemplateError> {
        let files = ModelFiles::locate(path)?;
        match &files.tokenizer {
            TokenizerFile::Json(file) => {
                let bytes = std::fs::read(file).map_err(|e| load_error(file, e))?;
                Self::from_bytes_with(&bytes, file.clone(), bench)
            }
            TokenizerFile::Tiktoken(file) => Self::from_tiktoken(file, &files),
        }
    }

    /// Builds a tokenizer from `tokenizer.json` bytes; `origin` is the file named in errors.
    pub fn from_bytes(bytes: &[u8], origin: PathBuf) -> Result<Self, TemplateError> {
        Self::from_bytes_with(bytes, origin, &Bench::default())
    }

    /// A tiktoken vocabulary with the `tokenizer_config.json` beside it, which must name
    /// Moonshot's class (the only tiktoken tokenizer spool reproduces). The digest covers
    /// both files: `cat tiktoken.model tokenizer_config.json | sha256sum`.
    fn from_tiktoken(file: &Path, files: &ModelFiles) -> Result<Self, TemplateError> {
        let config_path = files.tokenizer_config.as_ref().ok_or_else(|| {
            load_error(
                file,
                format!(
                    "a tiktoken vocabulary needs the `{TOKENIZER_CONFIG}` beside it (its special tokens)"
                ),
            )
        })?;
        let config_bytes = std::fs::read(config_path).map_err(|e| load_error(config_path, e))?;
        let config: JsonValue = serde_json::from_slice(&config_bytes)
            .map_err(|e| load_error(config_path, format!("not JSON: {e}")))?;
        if !names_vendor_class(&config) {
            return Err(load_error(
                config_path,
                format!(
                    "`auto_map.AutoTokenizer` does not name `{VENDOR_CLASS}`: spool reproduces \
                     the tiktoken tokenizer of Kimi (K2, K2.5, K2-Thinking) only"
                ),
            ));
        }
        let model = std::fs::read(file).map_err(|e| load_error(file, e))?;
        let bpe = TiktokenBpe::new(&model, &config).map_err(|e| match e {
            BadVocabulary::Ranks(_) => load_error(file, e),
            BadVocabulary::Config(_) => load_error(config_path, e),
        })?;
        let mut both = model;
        both.extend_from_slice(&config_bytes);
        Ok(Self {
            backend: Backend::Tiktoken(Arc::new(bpe)),
            sha256: sha256_hex(&both).into(),
            origin: file.into(),
            prefix_text: "".into(),
        })
    }

    /// [`Tokenizer::from_bytes`], with the shortcuts `bench` turns off left off.
    pub fn from_bytes_with(
        bytes: &[u8],
        origin: PathBuf,
        bench: &Bench,
    ) -> Result<Self, TemplateError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| load_error(&origin, format!("not a valid tokenizer.json: {e}")))?;
        // Counts must be true counts: never truncate or pad.
        inner
            .with_truncation(None)
            .map_err(|e| load_error(&origin, e))?;
        inner.with_padding(None);
        let prefix_text = special_prefix_text(&inner).map_err(|e| load_error(&origin, e))?;
        let nfc_bypass = match inner.get_normalizer() {
            Some(tokenizers::NormalizerWrapper::NFC(_)) if !bench.no_nfc_bypass => {
                let mut bare = inner.clone();
                bare.with_normalizer(None::<tokenizers::NormalizerWrapper>)
                    .map_err(|e| load_error(&origin, e))?;
                Some(Arc::new(bare))
            }
            _ => None,
        };
        let fast = if bench.no_fast_bpe {
            None
        } else {
            Self::fast_encoder(bytes, &inner, &origin)
        };
        Ok(Self {
            backend: Backend::Hf(Hf {
                inner: Arc::new(inner),
                nfc_bypass,
                fast,
            }),
            sha256: sha256_hex(bytes).into(),
            origin: origin.into(),
            prefix_text: prefix_text.into(),
        })
    }

    /// The fast encoder for this file, or `None` (logged) when it is not of the supported
    /// shape; never an error: `tokenizers` then does all the encoding.
    fn fast_encoder(
        bytes: &[u8],
        inner: &tokenizers::Tokenizer,
        origin: &Path,
    ) -> Option<Arc<ByteBpe>> {
        let json: JsonValue = serde_json::from_slice(bytes).ok()?;
        match ByteBpe::new(&json, inner) {
            Ok(fast) => {
                tracing::debug!(tokenizer = %origin.display(), "fast byte-level BPE encoder on");
                Some(Arc::new(fast))
            }
            Err(why) => {
                tracing::debug!(tokenizer = %origin.display(), %why, "fast encoder off");
                None
            }
        }
    }

    /// Whether the fast byte-level BPE encoder is in use (see [`crate::prompt::byte_bpe`]).
    pub fn has_fast_encoder(&self) -> bool {
        matches!(&self.backend, Backend::Hf(hf) if hf.fast.is_some())
    }

    /// Whether this is a tiktoken vocabulary (Kimi's) rather than a `tokenizer.json`.
    pub fn is_tiktoken(&self) -> bool {
        matches!(self.backend, Backend::Tiktoken(_))
    }

    fn error(&self, what: &str, err: impl fmt::Display) -> TemplateError {
        TemplateError::Tokenize {
            detail: format!("{}: {what}: {err}", self.origin.display()),
        }
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS/EOS as
    /// `tokenizer.json` defines them; Kimi's tokenizer adds none). Special-token text
    /// inside `text` is matched as special tokens, the `tokenizers` default and what
    /// Kimi's server-side tokenizer does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TemplateError> {
        use unicode_normalization_alignments::{is_nfc_quick, IsNormalized};
        let hf = match &self.backend {
            Backend::Tiktoken(bpe) => return Ok(bpe.encode(text)),
            Backend::Hf(hf) => hf,
        };
        if let Some(fast) = &hf.fast {
            if !fast.needs_nfc() || is_nfc_quick(text.chars()) == IsNormalized::Yes {
                return Ok(fast.encode(text));
            }
        }
        let tokenizer = match &hf.nfc_bypass {
            Some(bare) if is_nfc_quick(text.chars()) == IsNormalized::Yes => bare,
            _ => &hf.inner,
        };
        tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| self.error("cannot encode", e))
    }

    /// Ids of a raw `prompt` row: with special tokens, unless the text already starts
    /// with the tokens the tokenizer would prepend (no double BOS).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TemplateError> {
        let has_prefix = !self.prefix_text.is_empty() && text.starts_with(&*self.prefix_text);
        self.encode(text, !has_prefix)
    }

    /// Text of `ids`, special tokens included (the exact completion the model wrote).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TemplateError> {
        match &self.backend {
            Backend::Hf(hf) => hf
                .inner
                .decode(ids, false)
                .map_err(|e| self.error("cannot decode", e)),
            Backend::Tiktoken(bpe) => bpe.decode(ids).map_err(|id| {
                self.error(
                    "cannot decode",
                    format!("id {id} is past the vocabulary ({} ids)", bpe.vocab_size()),
                )
            }),
        }
    }

    /// Number of tokens in `text`, without special tokens.
    pub fn count(&self, text: &str) -> Result<usize, TemplateError> {
        self.encode(text, false).map(|ids| ids.len())
    }

    /// Hex sha256 of the tokenizer's files (goes into shard metadata): the
    /// `tokenizer.json` bytes, or `tiktoken.model` then `tokenizer_config.json`.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file the tokenizer came from (`tokenizer.json` or `tiktoken.model`); the
    /// model's other files are beside it.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Text of the tokens `encode(_, true)` prepends (such as `<s>`); empty if none.
    pub fn special_prefix(&self) -> &str {
        &self.prefix_text
    }

    /// Number of ids the tokenizer knows, added tokens included (a model's `vocab_size`
    /// may be larger: padded embedding rows no token maps to).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf(hf) => hf.inner.get_vocab_size(true),
            Backend::Tiktoken(bpe) => bpe.vocab_size(),
        }
    }

    /// The id of a token (such as `<|im_end|>`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf(hf) => hf.inner.token_to_id(token),
            Backend::Tiktoken(bpe) => bpe.token_to_id(token),
        }
    }
}

/// The text of the tokens the post-processor puts before a single sequence, found by
/// encoding a probe with and without special tokens.
fn special_prefix_text(tokenizer: &tokenizers::Tokenizer) -> Result<String, String> {
    let probe = "a";
    let plain = tokenizer
        .encode_fast(probe, false)
        .map_err(|e| format!("cannot encode a probe: {e}"))?;
    let full = tokenizer
        .encode_fast(probe, true)
        .map_err(|e| format!("cannot encode a probe: {e}"))?;
    let (plain, full) = (plain.get_ids(), full.get_ids());
    let start = (0..=full.len().saturating_sub(plain.len()))
        .find(|&i| full[i..].starts_with(plain))
        .unwrap_or(0);
    Ok(full[..start]
        .iter()
        .filter_map(|&id| tokenizer.id_to_token(id))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Tokenizer {
        fn hf(&self) -> &Hf {
            match &self.backend {
                Backend::Hf(hf) => hf,
                Backend::Tiktoken(_) => panic!("not a tokenizer.json"),
            }
        }
    }

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers")
            .join(rel)
    }

    /// Qwen3's tokenizer: no prefix, its file digest, special tokens matched in text,
    /// decode, count and token lookup.
    #[test]
    fn tokenizer_basics() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        assert_eq!(tokenizer.special_prefix(), "");
        assert_eq!(
            tokenizer.sha256(),
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
        );
        let ids = tokenizer.encode("Hello!<|im_end|>", false).unwrap();
        assert_eq!(ids, vec![9707, 0, 151645]);
        assert_eq!(tokenizer.decode(&ids).unwrap(), "Hello!<|im_end|>");
        assert_eq!(tokenizer.count("Hello!").unwrap(), 2);
        assert_eq!(tokenizer.encode_prompt("Hello!").unwrap(), vec![9707, 0]);
        assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(151645));
    }

    /// The Kimi folder loads as a tiktoken tokenizer (from the folder or its
    /// `tiktoken.model`): no prefix, the digest of both files, special tokens matched in
    /// text; a folder without a tokenizer file, and a tiktoken folder whose config names
    /// another class, are refused naming the folder or the config.
    #[test]
    fn kimi_folders_load_and_bad_folders_are_named() {
        let kimi = Tokenizer::from_file(&fixture("kimi-k2")).unwrap();
        assert!(kimi.is_tiktoken() && !kimi.has_fast_encoder());
        assert_eq!(kimi.origin(), fixture("kimi-k2/tiktoken.model"));
        assert_eq!(kimi.special_prefix(), "");
        let mut both = std::fs::read(fixture("kimi-k2/tiktoken.model")).unwrap();
        both.extend(std::fs::read(fixture("kimi-k2/tokenizer_config.json")).unwrap());
        assert_eq!(kimi.sha256(), sha256_hex(&both));
        let ids = kimi.encode("Hello!<|im_end|>", false).unwrap();
        assert_eq!(ids.last(), Some(&163_586));
        assert_eq!(kimi.encode_prompt("Hello!<|im_end|>").unwrap(), ids);
        assert_eq!(kimi.decode(&ids).unwrap(), "Hello!<|im_end|>");
        assert_eq!(kimi.vocab_size(), 163_840);
        let file = Tokenizer::from_file(&fixture("kimi-k2/tiktoken.model")).unwrap();
        assert_eq!(file.sha256(), kimi.sha256());
        let err = kimi.decode(&[163_840]).unwrap_err().to_string();
        assert!(
            err.contains("tiktoken.model") && err.contains("163840"),
            "{err}"
        );

        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
        assert!(
            err.contains("tokenizer.json") && err.contains("tiktoken.model"),
            "{err}"
        );
        std::fs::copy(
            fixture("kimi-k2/tiktoken.model"),
            dir.path().join("tiktoken.model"),
        )
        .unwrap();
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(err.contains("needs the `tokenizer_config.json`"), "{err}");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", null]}}"#,
        )
        .unwrap();
        let err = Tokenizer::from_file(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("tokenization_kimi"),
            "{err}"
        );
    }

    /// The fast encoder is chosen for Qwen3 and not for Phi-3, and gives `tokenizers`' ids
    /// for NFC text, with and without special tokens.
    #[test]
    fn the_fast_encoder_gives_the_tokenizers_ids() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        assert!(tokenizer.has_fast_encoder());
        let phi3 = Tokenizer::from_file(&fixture("phi3/tokenizer.json")).unwrap();
        assert!(!phi3.has_fast_encoder(), "Phi-3 is not byte-level BPE");
        // NFC text goes through the fast encoder, decomposed text through `tokenizers`
        // (which composes it): both must give the reference ids, with and without
        // special tokens.
        let texts = [
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nIt's   fine?\n\n",
            "Cafe\u{301} cre\u{300}me 中文 😀 ﬁ Ω Å 'LL 'ſ \u{a0}\u{3000} \r\n\t<think>x</think>",
            "def f(x):\n    return x ** 2  # ½ ²\n",
        ];
        for text in texts {
            for special in [false, true] {
                let want = tokenizer.hf().inner.encode_fast(text, special).unwrap();
                assert_eq!(
                    tokenizer.encode(text, special).unwrap(),
                    want.get_ids(),
                    "{text:?}"
                );
            }
        }
    }

    /// The NFC bypass is exact: NFC text gives the full pipeline's ids, and text that is
    /// not NFC still goes through the normaliser (decomposed "é" tokenizes as composed).
    #[test]
    fn the_nfc_bypass_gives_the_normalisers_ids() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        let hf = tokenizer.hf();
        let bare = hf.nfc_bypass.as_ref().expect("qwen3 normalises with NFC");
        let texts = [
            "Hello, world! <|im_start|>user\nCafé 中文 😀 ﬁ Ω Å\n\n  x",
            "def f(x):\n    return x ** 2  # ½ ²\n",
        ];
        for text in texts {
            let full = hf.inner.encode_fast(text, true).unwrap();
            assert_eq!(tokenizer.encode(text, true).unwrap(), full.get_ids());
            assert_eq!(
                bare.encode_fast(text, true).unwrap().get_ids(),
                full.get_ids()
            );
        }
        let decomposed = "Cafe\u{301} cre\u{300}me";
        let composed = "Caf\u{e9} cr\u{e8}me";
        assert_ne!(
            bare.encode_fast(decomposed, false).unwrap().get_ids(),
            tokenizer.encode(composed, false).unwrap()
        );
        assert_eq!(
            tokenizer.encode(decomposed, false).unwrap(),
            tokenizer.encode(composed, false).unwrap()
        );
    }

    /// The benchmark switches turn each shortcut off, and the ids stay those of the
    /// shortcuts: the ablation measures speed only.
    #[test]
    fn bench_switches_turn_the_shortcuts_off() {
        let path = fixture("qwen3/tokenizer.json");
        let on = Tokenizer::from_file(&path).unwrap();
        assert!(on.hf().fast.is_some() && on.hf().nfc_bypass.is_some());
        let off = Tokenizer::from_file_with(
            &path,
            &Bench {
                no_fast_bpe: true,
                no_nfc_bypass: true,
                ..Bench::default()
            },
        )
        .unwrap();
        assert!(off.hf().fast.is_none() && off.hf().nfc_bypass.is_none());
        let text = "<|im_start|>user\nCafé 中文 😀 It's   fine?<|im_end|>\n";
        assert_eq!(
            off.encode(text, false).unwrap(),
            on.encode(text, false).unwrap()
        );
        assert_eq!(off.sha256(), on.sha256());
    }
}
