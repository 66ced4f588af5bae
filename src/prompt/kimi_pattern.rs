//! The pre-tokenizer split of Kimi's tiktoken tokenizer: [`KIMI_PATTERN`] (the `pat_str`
//! of Moonshot's `tokenization_kimi.py`) implemented by hand, so [`super::tiktoken`] need
//! not run a backtracking regex.
//!
//! Invariant: `KimiClasses::piece_end` cuts text exactly where [`KIMI_PATTERN`] matches
//! it under tiktoken's regex semantics (leftmost-first alternation, greedy runs that give
//! back characters when the rest of an alternative fails, `\s+(?!\S)`). The character
//! classes, including the class intersections that keep Han out of the letter runs, come
//! from `regex-syntax`, the tables tiktoken's regex is compiled from.

use super::pretokenize::{
    char_at, skip_newlines, space_piece_end, unicode_class, CodeTable, Contractions,
};

/// The `pat_str` of Moonshot's `TikTokenTokenizer` (Kimi K2, K2.5, K2-Thinking), joined
/// as the vendor joins its eight alternatives.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// `\p{Han}`.
const HAN: u8 = 1;
/// `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]`: the head of a word.
const HEAD: u8 = 2;
/// `[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]`: the tail of a word.
const TAIL: u8 = 4;
/// `\p{L}`.
const LETTER: u8 = 8;
/// `\p{N}`.
const NUMBER: u8 = 16;
/// `\s`.
const SPACE: u8 = 32;

/// The classes [`KIMI_PATTERN`] tests, per code point, as bit flags (a code point can be
/// in several: `Lm`, `Lo` and marks are both head and tail).
pub(super) struct KimiClasses {
    table: CodeTable<u8>,
    contractions: Contractions,
}

impl KimiClasses {
    pub(super) fn new() -> Result<Self, String> {
        let classes: [(&str, u8); 6] = [
            (r"\p{Han}", HAN),
            (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", HEAD),
            (r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", TAIL),
            (r"\p{L}", LETTER),
            (r"\p{N}", NUMBER),
            (r"\s", SPACE),
        ];
        let mut bmp = vec![0u8; 0x10000];
        let mut astral_sets = Vec::new();
        for (pattern, flag) in classes {
            let ranges = unicode_class(pattern)?;
            for &(lo, hi) in &ranges {
                for u in lo..=hi.min(0xFFFF) {
                    bmp[u as usize] |= flag;
                }
            }
            let above: Vec<(u32, u32)> = ranges
                .into_iter()
                .filter(|&(_, hi)| hi > 0xFFFF)
                .map(|(lo, hi)| (lo.max(0x10000), hi))
                .collect();
            astral_sets.push((above, flag));
        }
        // Elementary intervals between every range boundary, each with the flags of the
        // classes that contain it.
        let mut cuts: Vec<u32> = astral_sets
            .iter()
            .flat_map(|(r, _)| r.iter().flat_map(|&(lo, hi)| [lo, hi + 1]))
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut astral: Vec<(u32, u32, u8)> = Vec::new();
        for w in cuts.windows(2) {
            let (lo, hi) = (w[0], w[1] - 1);
            let flags = astral_sets
                .iter()
                .filter(|(r, _)| r.iter().any(|&(a, b)| a <= lo && hi <= b))
                .fold(0u8, |f, (_, flag)| f | flag);
            if flags == 0 {
                continue;
            }
            match astral.last_mut() {
                Some(last) if last.1 + 1 == lo && last.2 == flags => last.1 = hi,
                _ => astral.push((lo, hi, flags)),
            }
        }
        Ok(Self {
            table: CodeTable::new(bmp, astral, 0),
            contractions: Contractions::new()?,
        })
    }

    #[inline]
    fn of(&self, c: char) -> u8 {
        self.table.get(c)
    }

    /// The end of the run of characters with any of `flags` from `i`.
    #[inline]
    fn skip(&self, s: &str, mut i: usize, flags: u8) -> usize {
        while let Some((c, len)) = char_at(s, i) {
            if self.of(c) & flags == 0 {
                break;
            }
            i += len;
        }
        i
    }

    /// The end of an optional contraction at `i` (`i` itself when there is none).
    #[inline]
    fn contraction(&self, s: &str, i: usize) -> usize {
        if s.as_bytes().get(i) == Some(&b'\'') {
            if let Some(end) = self.contractions.end(s, i + 1) {
                return end;
            }
        }
        i
    }

    /// `HEAD* TAIL+ contraction?` from `p`: the greedy head run gives back characters
    /// one at a time until a tail character can follow it.
    fn head_then_tail(&self, s: &str, p: usize) -> Option<usize> {
        let e = self.skip(s, p, HEAD);
        if let Some((c, _)) = char_at(s, e) {
            if self.of(c) & TAIL != 0 {
                let f = self.skip(s, e, TAIL);
                return Some(self.contraction(s, f));
            }
        }
        // Backtracking: the tail is the last tail character of the head run, alone
        // (what follows it in the run is not tail, nor is the character at `e`).
        let mut last_tail_end = None;
        let mut j = p;
        while j < e {
            let Some((c, len)) = char_at(s, j) else { break };
            if self.of(c) & TAIL != 0 {
                last_tail_end = Some(j + len);
            }
            j += len;
        }
        last_tail_end.map(|end| self.contraction(s, end))
    }

    /// `HEAD+ TAIL* contraction?` from `p`.
    fn head_run(&self, s: &str, p: usize) -> Option<usize> {
        let e = self.skip(s, p, HEAD);
        if e == p {
            return None;
        }
        let f = self.skip(s, e, TAIL);
        Some(self.contraction(s, f))
    }

    /// The end of the match of [`KIMI_PATTERN`] that starts at byte `i` of `s` (`i <
    /// s.len()`, on a character boundary). Every character starts a match of one
    /// alternative and none matches the empty string, so the result is always past `i`.
    pub(super) fn piece_end(&self, s: &str, i: usize) -> usize {
        let Some((c0, l0)) = char_at(s, i) else {
            return s.len();
        };
        let f0 = self.of(c0);
        let i1 = i + l0;
        // [\p{Han}]+
        if f0 & HAN != 0 {
            return self.skip(s, i1, HAN);
        }
        // [^\r\n\p{L}\p{N}]? then a word: the optional prefix is taken first and dropped
        // only when the word cannot follow it.
        let prefix = f0 & (LETTER | NUMBER) == 0 && c0 != '\r' && c0 != '\n';
        if prefix {
            if let Some(end) = self.head_then_tail(s, i1) {
                return end;
            }
        }
        if let Some(end) = self.head_then_tail(s, i) {
            return end;
        }
        if prefix {
            if let Some(end) = self.head_run(s, i1) {
                return end;
            }
        }
        if let Some(end) = self.head_run(s, i) {
            return end;
        }
        // \p{N}{1,3}
        if f0 & NUMBER != 0 {
            let mut end = i1;
            for _ in 0..2 {
                match char_at(s, end) {
                    Some((c, len)) if self.of(c) & NUMBER != 0 => end += len,
                    _ => break,
                }
            }
            return end;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let other = |f: u8| f & (SPACE | LETTER | NUMBER) == 0;
        if other(f0) {
            return skip_newlines(s, self.skip_other(s, i1));
        }
        if c0 == ' ' {
            if let Some((c1, l1)) = char_at(s, i1) {
                if other(self.of(c1)) {
                    return skip_newlines(s, self.skip_other(s, i1 + l1));
                }
            }
        }
        // `c0` is whitespace from here.
        space_piece_end(s, i, |c| self.of(c) & SPACE != 0)
    }

    /// The end of the run of `[^\s\p{L}\p{N}]` from `i`.
    #[inline]
    fn skip_other(&self, s: &str, mut i: usize) -> usize {
        while let Some((c, len)) = char_at(s, i) {
            if self.of(c) & (SPACE | LETTER | NUMBER) != 0 {
                break;
            }
            i += len;
        }
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn classes() -> &'static KimiClasses {
        static C: OnceLock<KimiClasses> = OnceLock::new();
        C.get_or_init(|| KimiClasses::new().unwrap())
    }

    fn regex() -> &'static fancy_regex::Regex {
        static R: OnceLock<fancy_regex::Regex> = OnceLock::new();
        R.get_or_init(|| fancy_regex::Regex::new(KIMI_PATTERN).unwrap())
    }

    fn pieces(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let e = classes().piece_end(text, i);
            assert!(e > i, "empty piece at {i} of {text:?}");
            out.push(&text[i..e]);
            i = e;
        }
        out
    }

    fn regex_pieces(text: &str) -> Vec<&str> {
        regex()
            .find_iter(text)
            .map(|m| m.unwrap().as_str())
            .collect()
    }

    /// Edge cases of every alternative split where the regex (the engine tiktoken runs)
    /// splits them: Han runs, head/tail backtracking, prefixes, contractions, numbers,
    /// punctuation with newlines, and each whitespace rule.
    #[test]
    fn splits_like_the_regex() {
        for text in [
            "",
            "Hello, world! It's 2024 and we'RE here; they'Ve I'M you'LL he'D 'S 'sa '",
            "中文字符，日本語のテキスト。한국어 café naïve e\u{301} Ελληνικά Кириллица",
            "abc中文def 中 文 x中y 〇一二 々 ⺀⺁ 〡〢 ㊀",
            "ABCdef ABC DEF's HTTPServer iPhone McDonald'S XMLHttpRequest ǅungla ǅ",
            "ʰʰʰ ʰa aʰ Aʰ ʰA ÅA\u{30a}b A\u{301} \u{301}\u{301} \u{301}a x\u{301}Y",
            "ᾈᾉ ᾼα Σσς ﬁ ﬃ ＡＢｃ",
            "12345 ½¼ ٣٤٥٦ ⅷⅸ 1a2b 9,999.99 1'000",
            "  leading  and trailing  \n\n\t x\r\n y \u{a0}z\u{3000}a   ",
            "a  b\n \n  c \t\t!\n\n\r (x) [y] {z} --flag=1 a+b*c ... !!! ?!\n",
            " !a\t!\u{1c}\u{1f}x 'll'LL'Ll 'ſ 'K'ST x'Ll\r\r\n  \u{2028}\u{85} \u{b} \u{c}end",
            "😀👍🏽 🇫🇷 👨\u{200d}👩\u{200d}👧 ☃\u{fe0f} a😀b",
            "def f(x):\n    return x ** 2  # ½ ²\n",
            "'re're 're ' ''s 's\u{301}",
        ] {
            assert_eq!(pieces(text), regex_pieces(text), "{text:?}");
        }
    }

    /// Every seventh code point gets the flags the regex gives it.
    #[test]
    fn flags_are_the_regex_classes() {
        let checks: [(&str, u8); 6] = [
            (r"^\p{Han}$", HAN),
            (r"^[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]$", HEAD),
            (r"^[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]$", TAIL),
            (r"^\p{L}$", LETTER),
            (r"^\p{N}$", NUMBER),
            (r"^\s$", SPACE),
        ];
        let res: Vec<(regex::Regex, u8)> = checks
            .iter()
            .map(|(p, f)| (regex::Regex::new(p).unwrap(), *f))
            .collect();
        for c in (0..0x11_0000u32).step_by(7).filter_map(char::from_u32) {
            let s = c.to_string();
            let want = res
                .iter()
                .filter(|(r, _)| r.is_match(&s))
                .fold(0u8, |f, (_, flag)| f | flag);
            assert_eq!(classes().of(c), want, "U+{:04X}", c as u32);
        }
    }

    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[a-zA-Z]{1,8}",
            2 => "[中文字符日本語〇々⺀〡]{1,4}",
            2 => "[ʰǅÅαΣκﬁ\u{301}\u{308}\u{30a}]{1,4}",
            2 => "[ \t\n\r\u{a0}\u{3000}\u{1c}\u{85}]{1,4}",
            2 => "'(s|t|re|ve|m|ll|d|S|T|RE|Ll|ſ|K|x)?",
            2 => "[0-9½٣ⅷ]{1,5}",
            2 => "[!-/:-@\\[-`{-~]{1,3}",
            1 => "[😀👍🏽🇫🇷\u{200d}\u{fe0f}]{1,3}",
            1 => "\\PC{1,4}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// Text mixing every class the pattern distinguishes splits as the regex splits it.
        #[test]
        fn mixed_text_splits_like_the_regex(parts in prop::collection::vec(fragment(), 0..20)) {
            let text: String = parts.concat();
            prop_assert_eq!(pieces(&text), regex_pieces(&text), "{:?}", text);
        }

        /// Arbitrary printable text splits as the regex splits it.
        #[test]
        fn arbitrary_text_splits_like_the_regex(text in "\\PC{0,48}") {
            prop_assert_eq!(pieces(&text), regex_pieces(&text), "{:?}", text);
        }
    }
}
