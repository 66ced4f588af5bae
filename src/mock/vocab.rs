//! `--tokenizer`: the mock's completions made of real tokens of a real tokenizer (a
//! `tokenizer.json`, or a model folder such as Kimi's with its tiktoken vocabulary), so
//! ids, text and counts are what a server running that model would send.
//!
//! The plan is drawn exactly as in the default mode (same lengths, same word draws), then
//! each synthetic id is replaced by real ones:
//! - word `t` becomes `WORDS[t % n]`, one of a fixed list of English words written with a
//!   leading space, kept only when `" word"` encodes to exactly one id (checked at start-up;
//!   at least [`MIN_WORDS`] must survive);
//! - a think block's open marker becomes `<think>` `\n`, its close marker `\n` `</think>`
//!   `\n\n` (the `\n` before `</think>` is left out right after the open marker's `\n`,
//!   which would otherwise merge into one `\n\n` token).
//!
//! Invariants:
//! - Encoding the completion text (no special tokens added) gives exactly the ids sent,
//!   because every word is letters after one space and the markers are special tokens or
//!   newlines the pre-tokenizer splits at. The unit tests check it on the Qwen3 and Kimi
//!   fixtures.
//! - The cap applies to real ids: a plan cut by `max_tokens` holds `max_tokens` ids and
//!   finishes `length`; otherwise it finishes `stop`, and with `--eos-in-ids` ends with the
//!   tokenizer's end-of-turn id (`eos_token` of the `tokenizer_config.json` beside it), whose
//!   text is empty as with `skip_special_tokens`. Counts are the ids' length, that id included.
//! - No tool calls: a request offering tools is answered with text.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use super::sim::{Finish, LengthModel, Limits, Plan, Shape, Think, THINK_CLOSE, THINK_OPEN, VOCAB};
use crate::prompt::end_of_turn::end_of_turn_of;
use crate::prompt::tokenizer::Tokenizer;

/// Fewest usable words: fewer would make the outputs too repetitive to stand for text.
pub(crate) const MIN_WORDS: usize = 64;

/// Candidate words, each tried as `" word"`.
const WORDS: &[&str] = &[
    "the",
    "and",
    "of",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "with",
    "as",
    "was",
    "on",
    "be",
    "at",
    "by",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "another",
    "came",
    "come",
    "work",
    "three",
    "word",
    "must",
    "because",
    "does",
    "part",
    "even",
    "place",
    "well",
    "such",
    "here",
    "take",
    "why",
    "things",
    "help",
    "put",
    "years",
    "different",
    "away",
    "again",
    "off",
    "went",
    "old",
    "number",
    "great",
    "tell",
    "men",
    "say",
    "small",
    "every",
    "found",
    "still",
    "between",
    "name",
    "should",
    "home",
    "big",
    "give",
    "air",
    "line",
    "set",
    "own",
    "under",
    "read",
    "last",
    "never",
    "us",
    "left",
    "end",
    "along",
    "while",
    "might",
    "next",
    "sound",
    "below",
    "saw",
    "something",
    "thought",
    "both",
    "few",
    "those",
    "always",
    "show",
    "large",
    "often",
    "together",
    "asked",
    "house",
    "world",
    "going",
    "want",
    "school",
    "important",
    "until",
    "form",
    "food",
    "keep",
    "children",
    "land",
    "side",
    "without",
    "once",
    "life",
    "enough",
    "took",
    "four",
    "head",
    "above",
    "kind",
    "began",
    "almost",
    "live",
    "page",
    "got",
    "earth",
    "need",
    "far",
    "hand",
    "high",
    "year",
    "light",
    "country",
    "let",
    "night",
    "following",
    "being",
    "study",
    "second",
    "soon",
    "story",
    "since",
    "white",
    "days",
    "ever",
    "paper",
    "hard",
    "near",
    "better",
    "best",
    "across",
    "during",
    "today",
    "however",
    "sure",
    "means",
    "knew",
    "try",
    "told",
    "young",
    "sun",
    "thing",
    "whole",
    "hear",
    "example",
    "several",
    "change",
    "answer",
    "room",
    "sea",
    "against",
    "top",
    "turned",
    "learn",
    "point",
    "city",
    "play",
    "toward",
    "five",
    "using",
];

/// A real tokenizer's words and markers, as the mock's output alphabet.
#[derive(Debug)]
pub(crate) struct RealVocab {
    /// `(id, text)` of each usable word.
    words: Vec<(u32, String)>,
    think_open: u32,
    think_close: u32,
    nl: u32,
    nl2: u32,
    /// The end-of-turn id, sent as the last id of a stopped completion when `eos_in_ids`
    /// (Qwen's `<|im_end|>` when the tokenizer names none and it is not sent).
    pub eos: u32,
    eos_in_ids: bool,
    /// Text of every id an output can hold.
    texts: HashMap<u32, String>,
}

fn one_id(tok: &Tokenizer, text: &str) -> Result<Option<u32>> {
    let ids = tok
        .encode(text, false)
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("cannot encode {text:?}"))?;
    Ok(match ids[..] {
        [id] => Some(id),
        _ => None,
    })
}

impl RealVocab {
    /// Loads the tokenizer at `path` (a file or a model folder) and checks the words and
    /// markers it needs.
    pub(crate) fn load(path: &Path, eos_in_ids: bool) -> Result<Self> {
        let tok = Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| format!("--tokenizer {}", path.display()))?;
        let mut texts = HashMap::new();
        let mut words = Vec::new();
        for w in WORDS {
            let text = format!(" {w}");
            if let Some(id) = one_id(&tok, &text)? {
                texts.insert(id, text.clone());
                words.push((id, text));
            }
        }
        if words.len() < MIN_WORDS {
            bail!(
                "--tokenizer {}: only {} of the mock's {} words are single tokens (need {MIN_WORDS})",
                path.display(),
                words.len(),
                WORDS.len()
            );
        }
        let marker = |text: &str| -> Result<u32> {
            let id = one_id(&tok, text)?.ok_or_else(|| {
                anyhow!(
                    "--tokenizer {}: {text:?} is not one token (the mock's think block needs it)",
                    path.display()
                )
            })?;
            Ok(id)
        };
        let (think_open, think_close) = (marker("<think>")?, marker("</think>")?);
        let (nl, nl2) = (marker("\n")?, marker("\n\n")?);
        for (id, text) in [
            (think_open, "<think>"),
            (think_close, "</think>"),
            (nl, "\n"),
            (nl2, "\n\n"),
        ] {
            texts.insert(id, text.to_string());
        }
        // Only `--eos-in-ids` needs the tokenizer's own end of turn; otherwise it is just
        // the id `/generate` reports as matched.
        let eos = match end_of_turn_of(tok.origin(), &tok).map_err(anyhow::Error::msg)? {
            Some(e) => e.id,
            None if !eos_in_ids => super::sim::EOS_ID,
            None => bail!(
                "--eos-in-ids: no `eos_token` in the tokenizer_config.json beside {}",
                path.display()
            ),
        };
        Ok(Self {
            words,
            think_open,
            think_close,
            nl,
            nl2,
            eos,
            eos_in_ids,
            texts,
        })
    }

    /// Appends the text of `ids` to `s` (the end-of-turn id and unknown ids read as nothing).
    pub(crate) fn push_text(&self, s: &mut String, ids: &[u32]) {
        for id in ids {
            if let Some(t) = self.texts.get(id) {
                s.push_str(t);
            }
        }
    }

    /// The plan of a request in real ids: the synthetic plan (uncapped unless `ignore_eos`,
    /// tools never offered) translated, then capped.
    pub(crate) fn plan(
        &self,
        lengths: &LengthModel,
        key: u64,
        limits: Limits,
        think: Think,
    ) -> Plan {
        let synth_limits = Limits {
            max_tokens: if limits.ignore_eos {
                limits.max_tokens
            } else {
                u32::MAX
            },
            ..limits
        };
        let synth = lengths.plan(key, synth_limits, Shape { think, tools: &[] });
        // starts[i]: where synthetic id i begins among the real ids.
        let mut starts = Vec::with_capacity(synth.ids.len() + 1);
        let mut ids: Vec<u32> = Vec::with_capacity(synth.ids.len() + 4);
        for &t in &synth.ids {
            starts.push(ids.len());
            match t {
                THINK_OPEN => ids.extend([self.think_open, self.nl]),
                THINK_CLOSE => {
                    if ids.last() != Some(&self.nl) {
                        ids.push(self.nl);
                    }
                    ids.extend([self.think_close, self.nl2]);
                }
                t => ids.push(self.words[(t % VOCAB) as usize % self.words.len()].0),
            }
        }
        starts.push(ids.len());
        let at = |i: usize| starts[i.min(synth.ids.len())];
        let thinking = at(synth.thinking.start)..at(synth.thinking.end);
        let think_end = at(synth.think_end);
        let max = limits.max_tokens as usize;
        let finish = if limits.ignore_eos || ids.len() >= max {
            ids.truncate(max);
            Finish::Length
        } else {
            if self.eos_in_ids {
                ids.push(self.eos);
            }
            Finish::Stop
        };
        Plan {
            ids,
            finish,
            thinking,
            think_end,
            tool: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers")
            .join(rel)
    }

    fn limits(max: u32) -> Limits {
        Limits {
            max_tokens: max,
            min_tokens: 0,
            ignore_eos: false,
        }
    }

    /// The ids a tokenizer's plans must use: `(think_open, think_close, nl, nl2)` and the
    /// end-of-turn id `--eos-in-ids` sends.
    struct Expect {
        markers: (u32, u32, u32, u32),
        eos: u32,
    }

    /// Encoding the text of every plan (think block or not, capped or not) gives back
    /// exactly its ids; think markers are the tokenizer's own; a stopped plan ends with
    /// the end-of-turn id only with `--eos-in-ids`, a capped one never.
    fn plans_round_trip(path: &Path, want: Expect) {
        let tok = Tokenizer::from_file(path).unwrap();
        let v = RealVocab::load(path, false).unwrap();
        assert!(v.words.len() >= 200, "{} words", v.words.len());
        assert_eq!((v.think_open, v.think_close, v.nl, v.nl2), want.markers);
        let (open, close, nl, nl2) = want.markers;
        let lengths = LengthModel::new(40.0, 0.8, 1, 7).unwrap();
        let mut thought = 0;
        for key in 0..200u64 {
            for think in [Think::Off, Think::Block, Think::Opened] {
                for max in [u32::MAX, 3, 17] {
                    let plan = v.plan(&lengths, key, limits(max), think);
                    let mut text = String::new();
                    v.push_text(&mut text, &plan.ids);
                    assert_eq!(tok.encode(&text, false).unwrap(), plan.ids, "{text:?}");
                    assert_eq!(tok.decode(&plan.ids).unwrap(), text);
                    assert!(plan.ids.len() <= max as usize);
                    assert_eq!(
                        plan.finish == Finish::Length,
                        plan.ids.len() == max as usize
                    );
                    if think == Think::Block && plan.ids.len() > 2 {
                        assert_eq!(plan.ids[..2], [open, nl]);
                        thought += 1;
                    }
                    if max == u32::MAX && think != Think::Off {
                        let t = &plan.ids[plan.think_end - 2..plan.think_end];
                        assert_eq!(t, [close, nl2]);
                        let mut r = String::new();
                        v.push_text(&mut r, &plan.ids[plan.thinking.clone()]);
                        assert!(r.starts_with(' ') && !r.contains('<'), "{r:?}");
                    }
                }
            }
        }
        assert!(thought > 100);
        let with_eos = RealVocab::load(path, true).unwrap();
        let stop = with_eos.plan(&lengths, 3, limits(u32::MAX), Think::Block);
        assert_eq!(stop.finish, Finish::Stop);
        assert_eq!(stop.ids.last(), Some(&want.eos));
        assert_eq!(
            &stop.ids[..stop.ids.len() - 1],
            &v.plan(&lengths, 3, limits(u32::MAX), Think::Block).ids[..]
        );
        let cut = with_eos.plan(&lengths, 3, limits(5), Think::Block);
        assert_eq!((cut.finish, cut.ids.len()), (Finish::Length, 5));
        assert_ne!(cut.ids.last(), Some(&want.eos));
    }

    /// Qwen3's `tokenizer.json`: `<think>`, `</think>`, `\n`, `\n\n` and `<|im_end|>`.
    #[test]
    fn real_plans_round_trip_through_qwen3() {
        plans_round_trip(
            &fixture("qwen3/tokenizer.json"),
            Expect {
                markers: (151667, 151668, 198, 271),
                eos: 151645,
            },
        );
    }

    /// Kimi's model folder (tiktoken): its special `<think>`/`</think>`, its newlines, and
    /// the `eos_token` of its `tokenizer_config.json` (`[EOS]`).
    #[test]
    fn real_plans_round_trip_through_kimi() {
        plans_round_trip(
            &fixture("kimi-k2"),
            Expect {
                markers: (163606, 163607, 198, 382),
                eos: 163585,
            },
        );
    }
}
