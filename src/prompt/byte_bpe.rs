//! The exact fast encoder for byte-level BPE tokenizers of the GPT-4 / Qwen2 family.
//!
//! HuggingFace `tokenizers` spends most of an encode in its general machinery: a
//! backtracking regex (fancy-regex) for the pre-tokenizer, a `String` per word and per
//! token, offsets nobody here reads. [`ByteBpe`] does the same job for one exact shape of
//! `tokenizer.json` (Qwen2/2.5/3's) with none of that, and gives the same ids.
//!
//! Invariants:
//!
//! - **Only the exact supported shape is accepted** ([`ByteBpe::new`] checks the file
//!   field by field, and the loaded HuggingFace tokenizer's own view of it): no
//!   normaliser or exactly NFC (the caller encodes only already-NFC text here, see
//!   [`ByteBpe::needs_nfc`]); pre-tokenizer exactly `Split` on [`PATTERN`] (`Isolated`,
//!   not inverted) then `ByteLevel` without prefix space or regex; post-processor none or
//!   `ByteLevel` (adds no ids); model `BPE` without dropout, unknown token, prefixes or
//!   suffixes, byte fallback or `ignore_merges`, every byte in the vocabulary, merges as
//!   pairs; added tokens without `lstrip`/`rstrip`/`single_word`/`normalized`. Anything
//!   else is [`Unsupported`] and the caller keeps HuggingFace's path.
//! - **Same ids as HuggingFace for every input**: added tokens are split out first,
//!   leftmost-longest (HuggingFace's `AddedVocabulary`); each remaining segment is split
//!   exactly as [`PATTERN`] matches it ([`super::pretokenize`]); each piece's UTF-8 bytes
//!   are merged by rank, lowest rank first and leftmost among equals (HuggingFace's
//!   `Word::merge_all`).
//! - A built-in probe set is encoded both ways when the encoder is built; any difference
//!   makes it [`Unsupported`] (a second line of defence behind the shape check).
//! - Merging and its per-thread word cache are the `merge` module's.

use ahash::AHashMap;
use serde_json::Value;

use super::merge::{pair_key, Merge, Merges, Scratch, Words};
use super::pretokenize::{Classes, PATTERN};

/// Why a `tokenizer.json` is not one [`ByteBpe`] can encode exactly (the caller then
/// uses HuggingFace's own path; this is not a failure).
#[derive(Debug, thiserror::Error)]
#[error("no fast byte-level BPE: {0}")]
pub struct Unsupported(String);

fn unsupported(what: impl Into<String>) -> Unsupported {
    Unsupported(what.into())
}

/// One added token as HuggingFace matches it: its exact text.
struct AddedToken {
    content: Box<[u8]>,
    id: u32,
}

/// Added tokens, found leftmost-longest as HuggingFace's `AddedVocabulary` does.
struct AddedTokens {
    /// Longest first, so the first that matches at a position is the longest.
    tokens: Vec<AddedToken>,
    /// Whether some token starts with this byte.
    first: [bool; 256],
}

impl AddedTokens {
    /// The first added token at or after byte `from`: (start, end, id).
    fn find(&self, s: &str, from: usize) -> Option<(usize, usize, u32)> {
        if self.tokens.is_empty() {
            return None;
        }
        let bytes = s.as_bytes();
        let mut i = from;
        while i < bytes.len() {
            if self.first[bytes[i] as usize] {
                let rest = &bytes[i..];
                if let Some(t) = self.tokens.iter().find(|t| rest.starts_with(&t.content)) {
                    return Some((i, i + t.content.len(), t.id));
                }
            }
            i += 1;
        }
        None
    }
}

/// The exact fast encoder (see the module docs): token ids of text, without offsets or
/// strings. Built only for the one supported shape of `tokenizer.json`.
pub struct ByteBpe {
    classes: Classes,
    added: AddedTokens,
    merges: Merges,
    nfc: bool,
}

impl std::fmt::Debug for ByteBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBpe")
            .field("merges", &self.merges.len())
            .field("added_tokens", &self.added.tokens.len())
            .field("nfc", &self.nfc)
            .finish()
    }
}

/// The GPT-2 byte-to-character table ByteLevel uses: printable Latin-1 bytes stand for
/// themselves, the others for U+0100 upwards in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\0');
    }
    table
}

fn field<'a>(obj: &'a Value, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Checks that `obj` is a JSON object whose keys are all in `allowed`.
fn only_keys(obj: &Value, what: &str, allowed: &[&str]) -> Result<(), Unsupported> {
    let map = obj
        .as_object()
        .ok_or_else(|| unsupported(format!("{what} is not an object")))?;
    match map.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(unsupported(format!("{what} has `{k}`"))),
        None => Ok(()),
    }
}

fn is_bool(obj: &Value, key: &str, want: bool) -> bool {
    obj.get(key).and_then(Value::as_bool) == Some(want)
}

fn null_or_empty(obj: &Value, key: &str) -> bool {
    match obj.get(key) {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.is_empty(),
        _ => false,
    }
}

impl ByteBpe {
    /// Builds the encoder for `json` (the parsed `tokenizer.json`) and `hf` (the same file
    /// loaded by HuggingFace, truncation and padding off), or says why this tokenizer is
    /// not of the exact supported shape. Also encodes a probe set both ways.
    pub fn new(json: &Value, hf: &tokenizers::Tokenizer) -> Result<Self, Unsupported> {
        only_keys(
            json,
            "tokenizer.json",
            &[
                "version",
                "truncation",
                "padding",
                "added_tokens",
                "normalizer",
                "pre_tokenizer",
                "post_processor",
                "decoder",
                "model",
            ],
        )?;
        if hf.get_truncation().is_some() || hf.get_padding().is_some() {
            return Err(unsupported("truncation or padding is on"));
        }
        if hf.get_encode_special_tokens() {
            return Err(unsupported("encode_special_tokens is on"));
        }
        let nfc = match field(json, "normalizer") {
            None => false,
            Some(n) if *n == serde_json::json!({"type": "NFC"}) => true,
            Some(_) => return Err(unsupported("normalizer other than NFC")),
        };
        match (nfc, hf.get_normalizer()) {
            (true, Some(tokenizers::NormalizerWrapper::NFC(_))) | (false, None) => {}
            _ => return Err(unsupported("normalizer differs from the file")),
        }
        Self::check_pre_tokenizer(json)?;
        match field(json, "post_processor") {
            None => {}
            Some(p) if p.get("type").and_then(Value::as_str) == Some("ByteLevel") => {
                only_keys(
                    p,
                    "post_processor",
                    &["type", "add_prefix_space", "trim_offsets", "use_regex"],
                )?;
            }
            Some(_) => return Err(unsupported("post-processor other than ByteLevel")),
        }
        let model = field(json, "model").ok_or_else(|| unsupported("no model"))?;
        only_keys(
            model,
            "model",
            &[
                "type",
                "dropout",
                "unk_token",
                "continuing_subword_prefix",
                "end_of_word_suffix",
                "fuse_unk",
                "byte_fallback",
                "ignore_merges",
                "vocab",
                "merges",
            ],
        )?;
        if model.get("type").and_then(Value::as_str) != Some("BPE")
            || field(model, "dropout").is_some()
            || field(model, "unk_token").is_some()
            || !null_or_empty(model, "continuing_subword_prefix")
            || !null_or_empty(model, "end_of_word_suffix")
            || !(field(model, "byte_fallback").is_none() || is_bool(model, "byte_fallback", false))
            || !(field(model, "ignore_merges").is_none() || is_bool(model, "ignore_merges", false))
        {
            return Err(unsupported("BPE options other than plain merges"));
        }
        let tokenizers::ModelWrapper::BPE(bpe) = hf.get_model() else {
            return Err(unsupported("the loaded model is not BPE"));
        };
        if bpe.dropout.is_some_and(|d| d != 0.0)
            || bpe.unk_token.is_some()
            || bpe
                .continuing_subword_prefix
                .as_deref()
                .is_some_and(|p| !p.is_empty())
            || bpe
                .end_of_word_suffix
                .as_deref()
                .is_some_and(|p| !p.is_empty())
            || bpe.byte_fallback
            || bpe.ignore_merges
        {
            return Err(unsupported("the loaded BPE has options"));
        }
        let vocab = bpe.get_vocab();
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (id, c) in byte_ids.iter_mut().zip(chars) {
            *id = *vocab
                .get(c.encode_utf8(&mut [0; 4]) as &str)
                .ok_or_else(|| unsupported(format!("byte {c:?} is not in the vocabulary")))?;
        }
        let merge_list = model
            .get("merges")
            .and_then(Value::as_array)
            .ok_or_else(|| unsupported("no merges"))?;
        let mut merges = AHashMap::with_capacity(merge_list.len());
        for (rank, pair) in merge_list.iter().enumerate() {
            let (a, b) = match pair.as_array().map(Vec::as_slice) {
                Some([Value::String(a), Value::String(b)]) => (a, b),
                _ => return Err(unsupported("merges are not [a, b] pairs")),
            };
            let (Some(&a_id), Some(&b_id), Some(&new_id)) = (
                vocab.get(a.as_str()),
                vocab.get(b.as_str()),
                vocab.get(format!("{a}{b}").as_str()),
            ) else {
                return Err(unsupported(format!(
                    "merge {a} {b} is outside the vocabulary"
                )));
            };
            let rank = u32::try_from(rank).map_err(|_| unsupported("too many merges"))?;
            // A later duplicate replaces an earlier one, as in HuggingFace's map.
            merges.insert(pair_key(a_id, b_id), Merge { rank, new_id });
        }
        let added = Self::added_tokens(hf)?;
        let encoder = Self {
            classes: Classes::new().map_err(unsupported)?,
            added,
            merges: Merges::new(byte_ids, merges),
            nfc,
        };
        encoder.self_check(hf)?;
        Ok(encoder)
    }

    fn check_pre_tokenizer(json: &Value) -> Result<(), Unsupported> {
        let pre = field(json, "pre_tokenizer").ok_or_else(|| unsupported("no pre-tokenizer"))?;
        only_keys(pre, "pre_tokenizer", &["type", "pretokenizers"])?;
        let steps = match (
            pre.get("type").and_then(Value::as_str),
            pre.get("pretokenizers"),
        ) {
            (Some("Sequence"), Some(Value::Array(steps))) => steps,
            _ => return Err(unsupported("pre-tokenizer is not a Sequence")),
        };
        let [split, byte_level] = steps.as_slice() else {
            return Err(unsupported("pre-tokenizer is not Split then ByteLevel"));
        };
        only_keys(split, "Split", &["type", "pattern", "behavior", "invert"])?;
        let pattern = split.get("pattern").and_then(|p| {
            only_keys(p, "pattern", &["Regex"]).ok()?;
            p.get("Regex")?.as_str()
        });
        if split.get("type").and_then(Value::as_str) != Some("Split")
            || pattern != Some(PATTERN)
            || split.get("behavior").and_then(Value::as_str) != Some("Isolated")
            || !is_bool(split, "invert", false)
        {
            return Err(unsupported(
                "Split is not the GPT-4/Qwen2 pattern, Isolated",
            ));
        }
        only_keys(
            byte_level,
            "ByteLevel",
            &["type", "add_prefix_space", "trim_offsets", "use_regex"],
        )?;
        if byte_level.get("type").and_then(Value::as_str) != Some("ByteLevel")
            || !is_bool(byte_level, "add_prefix_space", false)
            || !is_bool(byte_level, "use_regex", false)
        {
            return Err(unsupported("ByteLevel adds a prefix space or splits again"));
        }
        Ok(())
    }

    fn added_tokens(hf: &tokenizers::Tokenizer) -> Result<AddedTokens, Unsupported> {
        let mut tokens = Vec::new();
        let mut first = [false; 256];
        for (id, token) in hf.get_added_tokens_decoder() {
            if token.single_word || token.lstrip || token.rstrip || token.normalized {
                return Err(unsupported(format!(
                    "added token {:?} is single-word, stripped or normalised",
                    token.content
                )));
            }
            let content: Box<[u8]> = token.content.as_bytes().into();
            let Some(&b) = content.first() else {
                return Err(unsupported("an added token is empty"));
            };
            first[b as usize] = true;
            tokens.push(AddedToken { content, id });
        }
        // Longest first; ties (same length) cannot both match at one position unless
        // equal, and equal contents are one entry in HuggingFace's matcher: refuse them.
        tokens.sort_by(|a, b| {
            b.content
                .len()
                .cmp(&a.content.len())
                .then(a.content.cmp(&b.content))
        });
        if tokens.windows(2).any(|w| w[0].content == w[1].content) {
            return Err(unsupported("two added tokens have the same text"));
        }
        Ok(AddedTokens { tokens, first })
    }

    /// Encodes [`PROBES`] both ways; any difference is an [`Unsupported`].
    fn self_check(&self, hf: &tokenizers::Tokenizer) -> Result<(), Unsupported> {
        use unicode_normalization_alignments::UnicodeNormalization;
        for probe in PROBES {
            // The caller gives this encoder only NFC text when the normaliser is NFC.
            let probe = if self.nfc {
                probe.nfc().map(|(c, _)| c).collect()
            } else {
                probe.to_string()
            };
            let probe = probe.as_str();
            for special in [false, true] {
                let want = hf
                    .encode_fast(probe, special)
                    .map_err(|e| unsupported(format!("HuggingFace cannot encode a probe: {e}")))?;
                if self.encode(probe) != want.get_ids() {
                    return Err(unsupported(format!(
                        "differs from HuggingFace on {probe:?}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether the tokenizer normalises with NFC: text must then be NFC already (which
    /// the caller checks) for [`ByteBpe::encode`] to give HuggingFace's ids.
    pub fn needs_nfc(&self) -> bool {
        self.nfc
    }

    /// Token ids of `text`, exactly as HuggingFace's `encode(text, _)` (the supported
    /// post-processors add no ids, so with or without special tokens). With an NFC
    /// normaliser, `text` must already be NFC.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        let mut scratch = Scratch::default();
        self.merges
            .with_cache(|cache| self.encode_into(text, &mut out, &mut scratch, cache));
        out
    }

    fn encode_into(
        &self,
        text: &str,
        out: &mut Vec<u32>,
        scratch: &mut Scratch,
        mut cache: Option<&mut Words>,
    ) {
        let mut pos = 0;
        while pos < text.len() {
            let (end, token) = match self.added.find(text, pos) {
                Some((start, end, id)) => (start, Some((end, id))),
                None => (text.len(), None),
            };
            let segment = &text[pos..end];
            let mut i = 0;
            while i < segment.len() {
                let e = self.classes.piece_end(segment, i);
                debug_assert!(e > i, "empty piece at {i} of {segment:?}");
                let e = e.max(i + 1);
                self.merges.piece(
                    &segment.as_bytes()[i..e],
                    out,
                    scratch,
                    cache.as_deref_mut(),
                    |_| None,
                );
                i = e;
            }
            match token {
                Some((after, id)) => {
                    out.push(id);
                    pos = after;
                }
                None => pos = text.len(),
            }
        }
    }
}

/// Encoded both ways when an encoder is built: each alternative of [`PATTERN`] and its
/// edge cases, added tokens, and non-ASCII classes.
pub(super) const PROBES: &[&str] = &[
    "",
    "Hello, world! It's 2024 and we'RE here; they'Ve I'M you'LL he'D 'S 'sa '",
    "  leading  and trailing  \n\n\t x\r\n y \u{a0}z\u{3000}a   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start<|im_end|>|>x<|<||endoftext|>",
    "中文字符，日本語のテキスト。한국어 café naïve e\u{301} Ελληνικά Кириллица",
    "123 4567 ½ ⅷ ٣ 😀👍🏽 ... !!! ?!\n\n (x) [y] {z} --flag=1 a+b*c",
    "ſ 'ſ 'K 'K 'ST x'Ll\r\r\n  \u{2028}\u{85} \u{b} \u{c}end",
];

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn qwen3_bytes() -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/qwen3/tokenizer.json");
        std::fs::read(path).unwrap()
    }

    fn hf_and_fast() -> &'static (tokenizers::Tokenizer, ByteBpe) {
        static BOTH: OnceLock<(tokenizers::Tokenizer, ByteBpe)> = OnceLock::new();
        BOTH.get_or_init(|| {
            let bytes = qwen3_bytes();
            let mut hf = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
            hf.with_truncation(None).unwrap();
            hf.with_padding(None);
            let json: Value = serde_json::from_slice(&bytes).unwrap();
            let fast = ByteBpe::new(&json, &hf).unwrap();
            (hf, fast)
        })
    }

    /// HuggingFace's ids, with its NFC normaliser (so the text may be any form), and
    /// ours (on the NFC form, as the caller guarantees).
    fn both(text: &str) -> (Vec<u32>, Vec<u32>) {
        use unicode_normalization_alignments::UnicodeNormalization;
        let (hf, fast) = hf_and_fast();
        let want = hf.encode_fast(text, false).unwrap().get_ids().to_vec();
        let nfc: String = text.nfc().map(|(c, _)| c).collect();
        (want, fast.encode(&nfc))
    }

    /// The scan and the heap merge give the same ids for every prefix of the probes.
    #[test]
    fn both_merge_strategies_agree() {
        let (_, fast) = hf_and_fast();
        let mut scratch = Scratch::default();
        for text in PROBES
            .iter()
            .chain(&["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"])
        {
            for len in 2..=text.len() {
                let bytes = &text.as_bytes()[..len];
                let (mut a, mut b) = (Vec::new(), Vec::new());
                fast.merges.merge_scan(bytes, &mut a, &mut scratch);
                fast.merges.merge_heap(bytes, &mut b, &mut scratch);
                assert_eq!(a, b, "{:?}", String::from_utf8_lossy(bytes));
            }
        }
    }

    /// The probes and long runs of one character encode to HuggingFace's ids.
    #[test]
    fn probes_and_edge_cases_match_huggingface() {
        for text in PROBES.iter().copied().chain([
            "a\u{301}",
            "x".repeat(300).as_str(),
            " ".repeat(70).as_str(),
            "=".repeat(100).as_str(),
            "中文".repeat(80).as_str(),
            "\n".repeat(20).as_str(),
        ]) {
            let (want, got) = both(text);
            assert_eq!(got, want, "{text:?}");
        }
    }

    /// Any change to the supported shape, and Phi-3's tokenizer, is refused; without a
    /// normaliser the file is accepted and needs no NFC check.
    #[test]
    fn other_shapes_are_refused() {
        let bytes = qwen3_bytes();
        let hf = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
        let json: Value = serde_json::from_slice(&bytes).unwrap();
        let edit = |f: &dyn Fn(&mut Value)| {
            let mut j = json.clone();
            f(&mut j);
            ByteBpe::new(&j, &hf).is_err()
        };
        assert!(edit(&|j| j["pre_tokenizer"]["pretokenizers"][0]
            ["pattern"]["Regex"] =
            Value::from(PATTERN.replace(r"\p{N}|", r"\p{N}{1,3}|"))));
        assert!(edit(
            &|j| j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = Value::from("Removed")
        ));
        assert!(edit(
            &|j| j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = Value::from(true)
        ));
        assert!(edit(
            &|j| j["normalizer"] = serde_json::json!({"type": "NFKC"})
        ));
        assert!(edit(&|j| j["model"]["ignore_merges"] = Value::from(true)));
        assert!(edit(&|j| j["model"]["byte_fallback"] = Value::from(true)));
        assert!(edit(
            &|j| j["post_processor"] = serde_json::json!({"type": "TemplateProcessing"})
        ));
        assert!(edit(&|j| j["extra"] = Value::from(1)));
        // The Phi-3 tokenizer (SentencePiece-style BPE) is another shape altogether.
        let phi3 = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers/phi3/tokenizer.json");
        let bytes = std::fs::read(phi3).unwrap();
        let hf = tokenizers::Tokenizer::from_bytes(&bytes).unwrap();
        assert!(ByteBpe::new(&serde_json::from_slice(&bytes).unwrap(), &hf).is_err());
        // Without a normaliser it is accepted (and needs no NFC check).
        let mut j = json.clone();
        j["normalizer"] = Value::Null;
        let mut bare = hf_and_fast().0.clone();
        bare.with_normalizer(None::<tokenizers::NormalizerWrapper>)
            .unwrap();
        assert!(!ByteBpe::new(&j, &bare).unwrap().needs_nfc());
        assert!(hf_and_fast().1.needs_nfc());
    }

    /// Pieces that exercise every alternative of the pattern and the merges.
    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[a-zA-Z]{1,12}",
            2 => "[ \t\n\r]{1,5}",
            1 => Just("\u{a0}".to_string()),
            1 => Just("\u{3000}".to_string()),
            1 => Just("\u{2028}\u{85}\u{b}\u{c}".to_string()),
            2 => "'(s|t|re|ve|m|ll|d|S|T|RE|Re|rE|VE|M|LL|lL|D|ſ|K|x)?",
            2 => "[0-9]{1,6}",
            2 => "[!-/:-@\\[-`{-~]{1,4}",
            1 => "[½²٣ⅷ]{1,2}",
            2 => "[中文字符日本語のテキスト한국어]{1,8}",
            2 => "[éèçñüøåßÆŒ]{1,4}",
            1 => "[e\u{301}\u{308}a\u{300}]{1,4}",
            1 => "[😀👍🏽🇫🇷\u{200d}]{1,3}",
            2 => prop::sample::select(vec![
                "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                "<tool_call>", "<|im_start", "<|", "|>", "<", "<|fim_pad|>",
            ]).prop_map(str::to_string),
            1 => "\\PC{1,4}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Text built from fragments that exercise every alternative of the pattern and the
        /// merges encodes to HuggingFace's ids.
        #[test]
        fn fast_path_ids_equal_huggingface(parts in prop::collection::vec(fragment(), 0..24)) {
            let text: String = parts.concat();
            let (want, got) = both(&text);
            prop_assert_eq!(got, want, "{:?}", text);
        }

        /// Arbitrary printable text encodes to HuggingFace's ids.
        #[test]
        fn arbitrary_text_ids_equal_huggingface(text in "\\PC{0,64}") {
            let (want, got) = both(&text);
            prop_assert_eq!(got, want, "{:?}", text);
        }
    }
}
