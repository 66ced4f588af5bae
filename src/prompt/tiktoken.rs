//! Kimi's tokenizer: a tiktoken byte-level BPE (`tiktoken.model`) with the special block
//! and text handling of Moonshot's `TikTokenTokenizer` (`tokenization_kimi.py` of Kimi
//! K2, K2.5 and K2-Thinking), so prompts get the ids the server's tokenizer gives them.
//!
//! How the vendor builds it, and so how this does:
//! - Base ranks: `tiktoken.model`, one `base64(bytes) rank` per line; a token's id is its
//!   rank. Above them a block of [`SPECIAL_SLOTS`] special ids, each named by the
//!   `added_tokens_decoder` of `tokenizer_config.json`, the others
//!   `<|reserved_token_{id}|>`. Every one of them is matched in text.
//! - Text reaches the model through the server's `tokenizer(text)` (vLLM, and chat
//!   rendering everywhere): transformers' added-token trie first cuts out the tokens it
//!   knows (`bos`/`eos`/`unk`/`pad` and `additional_special_tokens` of the config), and
//!   each piece between them goes through the vendor's `encode`: cut into 400,000-character
//!   chunks, each cut again so that no run of whitespace or of non-whitespace (Python's
//!   `str.isspace`) is longer than 25,000 characters, each part encoded by tiktoken with
//!   every special token allowed. A cut changes ids only where it splits a pre-tokenizer
//!   piece, so text of at most 25,000 bytes takes one pass without any of it.
//! - tiktoken's encode: special tokens are found leftmost (no special text is a prefix of
//!   another here, so leftmost-first and leftmost-longest agree); the text between them is
//!   split by [`KIMI_PATTERN`] ([`super::kimi_pattern`]); a piece that is a token is that
//!   token, any other is merged from its bytes by the rank of each joined pair
//!   (`merge`: the lowest rank first, leftmost among equals).
//! - Decoding: the bytes of every id concatenated, then UTF-8 with U+FFFD for each
//!   ill-formed subsequence, as Python's `bytes.decode("utf-8", "replace")`.
//!
//! Invariant: `encode` gives the ids of the vendor's tokenizer called as the server calls
//! it; `tests/it/kimi_tokenizer.rs` checks it id for id against Python `tiktoken`.

use std::fmt;

use ahash::AHashMap;
use aho_corasick::{AhoCorasick, MatchKind};
use base64::Engine as _;
use serde_json::Value;

use super::kimi_pattern::KimiClasses;
pub use super::kimi_pattern::KIMI_PATTERN;
use super::merge::{pair_key, Merge, Merges, Scratch, Words};

/// Special ids above the base ranks (`num_reserved_special_tokens` of the vendor).
pub const SPECIAL_SLOTS: u32 = 256;
/// The vendor's `TIKTOKEN_MAX_ENCODE_CHARS`: text is encoded in chunks of this many
/// characters.
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// The vendor's `MAX_NO_WHITESPACES_CHARS`: no run of whitespace or of non-whitespace
/// characters longer than this is encoded in one piece.
pub const MAX_RUN_CHARS: usize = 25_000;
/// The class the vendor's `tokenizer_config.json` names (`auto_map.AutoTokenizer`).
pub const VENDOR_CLASS: &str = "tokenization_kimi.TikTokenTokenizer";

/// Why a tiktoken vocabulary or its `tokenizer_config.json` cannot be used; the caller
/// names the file the variant points at.
#[derive(Debug, thiserror::Error)]
pub enum BadVocabulary {
    /// `tiktoken.model` is malformed.
    #[error("{0}")]
    Ranks(String),
    /// `tokenizer_config.json` does not fit the vocabulary.
    #[error("{0}")]
    Config(String),
}

fn bad(what: impl Into<String>) -> BadVocabulary {
    BadVocabulary::Ranks(what.into())
}

fn bad_config(what: impl Into<String>) -> BadVocabulary {
    BadVocabulary::Config(what.into())
}

/// Python's `str.isspace`, which the vendor's run splitting uses (it differs from
/// Unicode `White_Space` on U+001C..U+001F).
pub fn is_python_space(c: char) -> bool {
    matches!(c,
        '\t'..='\r' | '\u{1c}'..='\u{20}' | '\u{85}' | '\u{a0}' | '\u{1680}'
        | '\u{2000}'..='\u{200a}' | '\u{2028}' | '\u{2029}' | '\u{202f}' | '\u{205f}'
        | '\u{3000}')
}

/// A Kimi tiktoken tokenizer (see the module docs). `Send + Sync`; share it in an `Arc`.
pub struct TiktokenBpe {
    classes: KimiClasses,
    merges: Merges,
    /// Bytes of a base token to its id.
    encoder: AHashMap<Box<[u8]>, u32>,
    /// Bytes of every base token, concatenated in id order, and where each starts.
    token_bytes: Vec<u8>,
    token_starts: Vec<u32>,
    /// Name of each special id, from the first one up.
    special_names: Vec<String>,
    /// Every special token, as tiktoken matches them.
    specials: AhoCorasick,
    /// The tokens transformers' added-token trie cuts out first, with their ids.
    trie: AhoCorasick,
    trie_ids: Vec<u32>,
}

impl fmt::Debug for TiktokenBpe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TiktokenBpe")
            .field("base", &self.base_len())
            .field("specials", &self.special_names.len())
            .field("trie", &self.trie_ids.len())
            .finish()
    }
}

/// A token name in `tokenizer_config.json`: a string, or an object with `content`.
fn token_name(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// Whether `config` (a parsed `tokenizer_config.json`) names the vendor's class.
pub fn names_vendor_class(config: &Value) -> bool {
    match config.pointer("/auto_map/AutoTokenizer") {
        Some(Value::String(s)) => s == VENDOR_CLASS,
        Some(Value::Array(a)) => a.iter().any(|v| v.as_str() == Some(VENDOR_CLASS)),
        _ => false,
    }
}

/// The ranks of `tiktoken.model`: each line `base64 rank`, blank lines skipped (as
/// tiktoken's `load_tiktoken_bpe`); ranks must be exactly 0..n, each bytes once.
fn parse_ranks(model: &[u8]) -> Result<Vec<Vec<u8>>, BadVocabulary> {
    let text = std::str::from_utf8(model).map_err(|_| bad("not UTF-8 text"))?;
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    let mut count = 0usize;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad(format!(
                "line {}: expected `base64 rank`, found {line:?}",
                n + 1
            )));
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| bad(format!("line {}: bad base64 {b64:?}: {e}", n + 1)))?;
        let rank: usize = rank
            .parse()
            .map_err(|_| bad(format!("line {}: bad rank {rank:?}", n + 1)))?;
        if bytes.is_empty() {
            return Err(bad(format!("line {}: empty token", n + 1)));
        }
        if rank >= 1 << 24 {
            return Err(bad(format!("line {}: rank {rank} is too large", n + 1)));
        }
        if by_rank.len() <= rank {
            by_rank.resize(rank + 1, None);
        }
        if by_rank[rank].replace(bytes).is_some() {
            return Err(bad(format!("line {}: rank {rank} appears twice", n + 1)));
        }
        count += 1;
    }
    if count == 0 {
        return Err(bad("no ranks"));
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(rank, b)| b.ok_or_else(|| bad(format!("rank {rank} is missing"))))
        .collect()
}

impl TiktokenBpe {
    /// Builds the tokenizer from the bytes of `tiktoken.model` and of the
    /// `tokenizer_config.json` beside it, as the vendor's class does; says what is wrong
    /// with either (the caller names the file).
    pub fn new(model: &[u8], config: &Value) -> Result<Self, BadVocabulary> {
        let ranks = parse_ranks(model)?;
        let n = u32::try_from(ranks.len()).map_err(|_| bad("too many ranks"))?;
        let mut encoder: AHashMap<Box<[u8]>, u32> = AHashMap::with_capacity(ranks.len());
        let mut token_bytes = Vec::new();
        let mut token_starts = Vec::with_capacity(ranks.len() + 1);
        for (id, bytes) in ranks.iter().enumerate() {
            token_starts.push(token_bytes.len() as u32);
            token_bytes.extend_from_slice(bytes);
            if encoder.insert(bytes.as_slice().into(), id as u32).is_some() {
                return Err(bad(format!("token {bytes:?} has two ranks")));
            }
        }
        token_starts
            .push(u32::try_from(token_bytes.len()).map_err(|_| bad("vocabulary is too large"))?);
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *encoder
                .get(&[b as u8][..])
                .ok_or_else(|| bad(format!("byte {b:#04x} is not a token")))?;
        }
        // Every way to join two tokens into a third: merging a pair costs one lookup.
        let mut pairs = AHashMap::with_capacity(ranks.len() * 4);
        for (id, bytes) in ranks.iter().enumerate() {
            for k in 1..bytes.len() {
                if let (Some(&a), Some(&b)) = (encoder.get(&bytes[..k]), encoder.get(&bytes[k..])) {
                    let id = id as u32;
                    pairs.insert(
                        pair_key(a, b),
                        Merge {
                            rank: id,
                            new_id: id,
                        },
                    );
                }
            }
        }
        let special_names = Self::special_block(n, config)?;
        let trie_names = Self::trie_tokens(config)?;
        let mut trie_ids = Vec::with_capacity(trie_names.len());
        for name in &trie_names {
            let slot = special_names
                .iter()
                .position(|s| s == name)
                .ok_or_else(|| {
                    bad_config(format!(
                    "special token {name:?} of tokenizer_config.json is not in the special block \
                     (ids {n}..{})",
                    n + SPECIAL_SLOTS
                ))
                })?;
            trie_ids.push(n + slot as u32);
        }
        let specials = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&special_names)
            .map_err(|e| bad_config(format!("cannot index the special tokens: {e}")))?;
        let trie = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&trie_names)
            .map_err(|e| bad_config(format!("cannot index the special tokens: {e}")))?;
        Ok(Self {
            classes: KimiClasses::new().map_err(bad)?,
            merges: Merges::new(byte_ids, pairs),
            encoder,
            token_bytes,
            token_starts,
            special_names,
            specials,
            trie,
            trie_ids,
        })
    }

    /// The names of the ids `n..n + 256`: `added_tokens_decoder`'s, else
    /// `<|reserved_token_{id}|>`. Names must be distinct and nonempty.
    fn special_block(n: u32, config: &Value) -> Result<Vec<String>, BadVocabulary> {
        let mut names: Vec<String> = (n..n + SPECIAL_SLOTS)
            .map(|id| format!("<|reserved_token_{id}|>"))
            .collect();
        if let Some(added) = config.get("added_tokens_decoder") {
            let added = added
                .as_object()
                .ok_or_else(|| bad_config("`added_tokens_decoder` is not an object"))?;
            for (key, token) in added {
                let id: u32 = key.parse().map_err(|_| {
                    bad_config(format!("`added_tokens_decoder`: key {key:?} is not an id"))
                })?;
                let name = token_name(token).ok_or_else(|| {
                    bad_config(format!("`added_tokens_decoder.{key}` has no `content`"))
                })?;
                if name.is_empty() {
                    return Err(bad_config(format!("`added_tokens_decoder.{key}` is empty")));
                }
                // The vendor names only the block; other ids it leaves to transformers.
                if let Some(slot) = id.checked_sub(n).filter(|s| *s < SPECIAL_SLOTS) {
                    names[slot as usize] = name.to_string();
                }
            }
        }
        let mut sorted: Vec<&String> = names.iter().collect();
        sorted.sort();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(bad_config(format!("two special ids are named {:?}", w[0])));
        }
        Ok(names)
    }

    /// The tokens transformers' trie knows: `bos_token` (default `[BOS]`), `eos_token`
    /// (default `[EOS]`), `unk_token`, `pad_token` and `additional_special_tokens` (default
    /// the vendor's list), as the vendor's `__init__` hands them to transformers.
    fn trie_tokens(config: &Value) -> Result<Vec<String>, BadVocabulary> {
        let mut out = Vec::new();
        for (key, default) in [
            ("bos_token", Some("[BOS]")),
            ("eos_token", Some("[EOS]")),
            ("unk_token", None),
            ("pad_token", None),
        ] {
            match config.get(key).filter(|v| !v.is_null()) {
                Some(v) => {
                    let name = token_name(v)
                        .ok_or_else(|| bad_config(format!("`{key}` is not a token name")))?;
                    out.push(name.to_string());
                }
                None => out.extend(default.map(str::to_string)),
            }
        }
        match config
            .get("additional_special_tokens")
            .filter(|v| !v.is_null())
        {
            Some(Value::Array(list)) => {
                for v in list {
                    let name = token_name(v).ok_or_else(|| {
                        bad_config("`additional_special_tokens` holds something not a token name")
                    })?;
                    out.push(name.to_string());
                }
            }
            Some(_) => return Err(bad_config("`additional_special_tokens` is not a list")),
            None => out.extend(
                [
                    "<|im_end|>",
                    "<|im_user|>",
                    "<|im_assistant|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    "[EOT]",
                    "<|im_system|>",
                    "<|im_middle|>",
                ]
                .map(str::to_string),
            ),
        }
        out.retain(|s| !s.is_empty());
        out.sort();
        out.dedup();
        Ok(out)
    }

    fn base_len(&self) -> u32 {
        self.token_starts.len() as u32 - 1
    }

    /// Number of ids: the base ranks and the special block.
    pub fn vocab_size(&self) -> usize {
        self.base_len() as usize + self.special_names.len()
    }

    /// The id of a special token by name, or of a base token by its byte-level name (the
    /// GPT-2 characters transformers' `get_vocab` shows for this tokenizer).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(slot) = self.special_names.iter().position(|s| s == token) {
            return Some(self.base_len() + slot as u32);
        }
        let bytes: Option<Vec<u8>> = token.chars().map(byte_of_char).collect();
        self.encoder.get(bytes?.as_slice()).copied()
    }

    /// Token ids of `text`, as the server's tokenizer gives them (see the module docs).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let mut scratch = Scratch::default();
        self.merges.with_cache(|mut cache| {
            // Cuts only matter past MAX_RUN_CHARS characters, which need more bytes.
            if text.len() <= MAX_RUN_CHARS {
                self.encode_part(text, &mut out, &mut scratch, cache.as_deref_mut());
                return;
            }
            let mut at = 0;
            for m in self.trie.find_iter(text) {
                self.encode_cut(
                    &text[at..m.start()],
                    &mut out,
                    &mut scratch,
                    cache.as_deref_mut(),
                );
                out.push(self.trie_ids[m.pattern().as_usize()]);
                at = m.end();
            }
            self.encode_cut(&text[at..], &mut out, &mut scratch, cache);
        });
        out
    }

    /// The vendor's `encode` of one piece of text: 400,000-character chunks, each cut at
    /// runs longer than 25,000 characters, each part encoded on its own.
    fn encode_cut(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        mut cache: Option<&mut Words>,
    ) {
        for_each_part(text, |part| {
            self.encode_part(part, out, scratch, cache.as_deref_mut())
        });
    }

    /// tiktoken's `encode` with every special token allowed.
    fn encode_part(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        mut cache: Option<&mut Words>,
    ) {
        let mut at = 0;
        for m in self.specials.find_iter(text) {
            self.encode_ordinary(&text[at..m.start()], out, scratch, cache.as_deref_mut());
            out.push(self.base_len() + m.pattern().as_u32());
            at = m.end();
        }
        self.encode_ordinary(&text[at..], out, scratch, cache);
    }

    /// Text without special tokens: pre-tokenized, then each piece a token or merged.
    fn encode_ordinary(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        mut cache: Option<&mut Words>,
    ) {
        let whole = |b: &[u8]| self.encoder.get(b).copied();
        let mut i = 0;
        while i < text.len() {
            let e = self.classes.piece_end(text, i).max(i + 1);
            self.merges.piece(
                &text.as_bytes()[i..e],
                out,
                scratch,
                cache.as_deref_mut(),
                whole,
            );
            i = e;
        }
    }

    /// The bytes of `id`, or `None` past the vocabulary.
    pub fn id_bytes(&self, id: u32) -> Option<&[u8]> {
        let n = self.base_len();
        if id < n {
            let (a, b) = (
                self.token_starts[id as usize] as usize,
                self.token_starts[id as usize + 1] as usize,
            );
            return Some(&self.token_bytes[a..b]);
        }
        self.special_names
            .get((id - n) as usize)
            .map(|s| s.as_bytes())
    }

    /// Text of `ids`: their bytes concatenated, ill-formed UTF-8 replaced by U+FFFD as
    /// Python's `decode("utf-8", "replace")` does; the first id past the vocabulary is
    /// the error.
    pub fn decode(&self, ids: &[u32]) -> Result<String, u32> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.id_bytes(id).ok_or(id)?);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// Calls `f` with each part of `text` the vendor encodes separately: chunks of
/// [`MAX_ENCODE_CHARS`] characters, each cut before the character that would make a run
/// of whitespace or of non-whitespace longer than [`MAX_RUN_CHARS`]. Empty text has no
/// parts.
pub fn for_each_part(text: &str, mut f: impl FnMut(&str)) {
    let mut chunk_start = 0;
    let mut chars = 0usize;
    let mut run = 0usize;
    let mut run_space = false;
    let mut part_start = 0;
    for (idx, c) in text.char_indices() {
        if chars == MAX_ENCODE_CHARS {
            f(&text[part_start..idx]);
            chunk_start = idx;
            part_start = idx;
            chars = 0;
        }
        let space = is_python_space(c);
        if idx == chunk_start || space != run_space {
            run = 1;
            run_space = space;
        } else {
            run += 1;
            if run > MAX_RUN_CHARS {
                f(&text[part_start..idx]);
                part_start = idx;
                run = 1;
            }
        }
        chars += 1;
    }
    if part_start < text.len() {
        f(&text[part_start..]);
    }
}

/// The byte a GPT-2 byte-level character stands for (the inverse of transformers'
/// `bytes_to_unicode`).
fn byte_of_char(c: char) -> Option<u8> {
    let u = c as u32;
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if u < 256 && printable(u) {
        return Some(u as u8);
    }
    // The others are numbered from U+0100 in byte order.
    let k = u.checked_sub(256)?;
    (0u32..256)
        .filter(|&b| !printable(b))
        .nth(k as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::sync::OnceLock;

    fn folder() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/kimi-k2")
    }

    fn kimi() -> &'static TiktokenBpe {
        static K: OnceLock<TiktokenBpe> = OnceLock::new();
        K.get_or_init(|| {
            let model = std::fs::read(folder().join("tiktoken.model")).unwrap();
            let config: Value = serde_json::from_slice(
                &std::fs::read(folder().join("tokenizer_config.json")).unwrap(),
            )
            .unwrap();
            TiktokenBpe::new(&model, &config).unwrap()
        })
    }

    /// A `tiktoken.model` of the 256 bytes (ranks 0..256) and then `tokens`.
    fn model_of(tokens: &[&str]) -> Vec<u8> {
        let bytes = (0..=255u8).map(|b| vec![b]);
        let rest = tokens.iter().map(|t| t.as_bytes().to_vec());
        bytes
            .chain(rest)
            .enumerate()
            .flat_map(|(rank, t)| {
                let b64 = base64::engine::general_purpose::STANDARD.encode(t);
                format!("{b64} {rank}\n").into_bytes()
            })
            .collect()
    }

    /// A config for a vocabulary of `n` ranks: `[BOS]` and `[EOS]` first in the block.
    fn small_config(n: u32) -> Value {
        serde_json::json!({
            "added_tokens_decoder": {
                n.to_string(): {"content": "[BOS]"},
                (n + 1).to_string(): {"content": "[EOS]"}},
            "additional_special_tokens": []})
    }

    /// The special block: 256 ids above the 163,584 ranks, named from
    /// `added_tokens_decoder`, the rest `<|reserved_token_{id}|>`; all matched in text.
    #[test]
    fn special_block_is_named_as_the_vendor_names_it() {
        let k = kimi();
        assert_eq!(k.vocab_size(), 163_840);
        assert_eq!(k.token_to_id("[BOS]"), Some(163_584));
        assert_eq!(k.token_to_id("<|im_end|>"), Some(163_586));
        assert_eq!(k.token_to_id("<think>"), Some(163_606));
        assert_eq!(k.token_to_id("[PAD]"), Some(163_839));
        assert_eq!(k.token_to_id("<|reserved_token_163589|>"), Some(163_589));
        assert_eq!(k.token_to_id("<|reserved_token_163838|>"), None);
        assert_eq!(k.id_bytes(163_592), Some(&b"<|reserved_token_163592|>"[..]));
        assert_eq!(k.id_bytes(163_840), None);
        assert_eq!(k.encode("a<|reserved_token_163600|>[EOS]<|im_end"), {
            let mut v = vec![k.token_to_id("a").unwrap(), 163_600, 163_585];
            v.extend(k.encode("<|im_end"));
            v
        });
        // Byte-level names of base tokens, as transformers' vocabulary shows them.
        assert_eq!(k.token_to_id("Ġthe"), Some(276));
        assert_eq!(k.token_to_id("Ċ"), Some(198));
    }

    /// A special name given twice, a trie token outside the block, and bad ranks are
    /// refused with what is wrong.
    #[test]
    fn bad_vocabularies_are_refused() {
        let model = b"YQ== 0\nYg== 1\n";
        let full = model_of(&[]);
        let err = |m: &[u8], c: Value| TiktokenBpe::new(m, &c).unwrap_err().to_string();
        assert!(err(model, Value::Null).contains("byte 0x00 is not a token"));
        assert!(err(b"YQ== 0\nYQ== 1\n", Value::Null).contains("has two ranks"));
        assert!(err(b"YQ== 1\n", Value::Null).contains("rank 0 is missing"));
        assert!(err(b"YQ==\n", Value::Null).contains("line 1"));
        assert!(err(b"!!! 0\n", Value::Null).contains("bad base64"));
        let twice = serde_json::json!({"added_tokens_decoder": {
            "256": {"content": "[BOS]"}, "300": {"content": "<|reserved_token_257|>"}}});
        assert!(err(&full, twice).contains("two special ids are named"));
        let stray = serde_json::json!({
            "added_tokens_decoder": {"256": {"content": "[BOS]"}},
            "eos_token": "<|nope|>", "additional_special_tokens": []});
        assert!(err(&full, stray).contains("\"<|nope|>\""));
        let ok = TiktokenBpe::new(&full, &small_config(256)).unwrap();
        assert_eq!(ok.vocab_size(), 512);
        assert_eq!(ok.token_to_id("[EOS]"), Some(257));
        assert_eq!(ok.token_to_id("<|im_end|>"), None);
    }

    /// Merging follows tiktoken: a piece that is a token is that token even when no
    /// chain of merges reaches it; otherwise the lowest-ranked join first.
    #[test]
    fn merges_follow_tiktoken() {
        // "ab" 256, "bc" 257, "abcd" 258: no chain of joins reaches "abcd".
        let model = model_of(&["ab", "bc", "abcd"]);
        let k = TiktokenBpe::new(&model, &small_config(259)).unwrap();
        let [c, d, e] = [b'c', b'd', b'e'].map(u32::from);
        // The whole piece is a token.
        assert_eq!(k.encode("abcd"), vec![258]);
        // "ab" (256) ranks before "bc" (257).
        assert_eq!(k.encode("abc"), vec![256, c]);
        assert_eq!(k.encode("bcd"), vec![257, d]);
        // Not a token: merged, and "abcd" is never reached.
        assert_eq!(k.encode("abcde"), vec![256, c, d, e]);
    }

    /// The vendor's cuts: runs of 25,000 characters stay whole, one more character
    /// starts a new part; chunks are 400,000 characters; U+001C is whitespace to Python.
    #[test]
    fn parts_are_cut_as_the_vendor_cuts_them() {
        let parts = |t: &str| {
            let mut v = Vec::new();
            for_each_part(t, |p| v.push(p.chars().count()));
            v
        };
        assert_eq!(parts(""), Vec::<usize>::new());
        assert_eq!(parts(&"a".repeat(25_000)), vec![25_000]);
        assert_eq!(parts(&"a".repeat(25_001)), vec![25_000, 1]);
        assert_eq!(parts(&"é".repeat(50_001)), vec![25_000, 25_000, 1]);
        let t = format!("{}{}", " ".repeat(25_001), "b".repeat(3));
        assert_eq!(parts(&t), vec![25_000, 4]);
        let t = format!("x{}", "\u{1c}".repeat(25_001));
        assert_eq!(parts(&t), vec![25_001, 1]);
        let t = "ab ".repeat(200_000);
        assert_eq!(parts(&t), vec![400_000, 200_000]);
        // The run count restarts at a chunk boundary.
        let t = "a".repeat(425_000);
        assert_eq!(parts(&t), vec![25_000; 17]);
        assert!(is_python_space('\u{1f}') && !is_python_space('\u{200b}'));
    }

    /// Decoding concatenates bytes and replaces ill-formed UTF-8 (a lone continuation
    /// byte, a truncated sequence) with one U+FFFD each; an id past the vocabulary is an
    /// error.
    #[test]
    fn decode_is_bytes_then_utf8() {
        let k = kimi();
        let text = "Hello 中文 😀<|im_end|>\n";
        assert_eq!(k.decode(&k.encode(text)).unwrap(), text);
        let byte = |b: u8| k.encoder[&[b][..]];
        let a = k.encoder[&b"a"[..]];
        assert_eq!(
            k.decode(&[byte(0x80), a, byte(0xe4), byte(0xb8), a])
                .unwrap(),
            "\u{fffd}a\u{fffd}a"
        );
        assert_eq!(k.decode(&[163_840]), Err(163_840));
    }
}
