//! The pre-tokenizer split of the GPT-4 / Qwen2 byte-level BPE tokenizers: [`PATTERN`]
//! implemented by hand, so [`super::byte_bpe`] need not run a backtracking regex.
//!
//! Invariant: [`Classes::piece_end`] cuts text exactly where [`PATTERN`] matches it
//! (leftmost-first alternation, greedy runs, `\s+(?!\S)` backtracking, case-insensitive
//! contractions). The character classes (`\p{L}`, `\p{N}`, `\s`, and the case folds of
//! the contraction letters) come from `regex-syntax`, the tables the regex HuggingFace
//! runs is compiled from, so the Unicode version is the same.

/// The `Split` pattern of the GPT-4 / Qwen2 pre-tokenizer, which [`ByteBpe`] implements
/// by hand; a `tokenizer.json` with any other pattern is not accepted.
pub const PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the pre-tokenizer pattern distinguishes about a character. The classes are
/// disjoint: `\p{L}`, `\p{N}` and `\s` share no character.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(super) enum Class {
    /// `\p{L}` (General_Category Lu, Ll, Lt, Lm, Lo).
    Letter,
    /// `\p{N}` (Nd, Nl, No).
    Number,
    /// `\s` (White_Space).
    Space,
    /// Everything else: `[^\s\p{L}\p{N}]`.
    Other,
}

/// Character classes, from the same `regex-syntax` tables HuggingFace's regex uses.
pub(super) struct Classes {
    table: CodeTable<Class>,
    contractions: Contractions,
}

/// A value per code point: a table for the BMP, sorted disjoint ranges above it, and the
/// value of every code point in no range.
pub(super) struct CodeTable<T> {
    bmp: Vec<T>,
    astral: Vec<(u32, u32, T)>,
    none: T,
}

impl<T: Copy> CodeTable<T> {
    /// `bmp` holds 65,536 values; `astral` sorted, disjoint ranges above U+FFFF.
    pub(super) fn new(bmp: Vec<T>, astral: Vec<(u32, u32, T)>, none: T) -> Self {
        debug_assert!(bmp.len() == 0x10000 && astral.windows(2).all(|w| w[0].1 < w[1].0));
        Self { bmp, astral, none }
    }

    #[inline]
    pub(super) fn get(&self, c: char) -> T {
        let u = c as u32;
        if let Some(&v) = self.bmp.get(u as usize) {
            return v;
        }
        match self.astral.binary_search_by(|&(lo, hi, _)| {
            if hi < u {
                std::cmp::Ordering::Less
            } else if lo > u {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        }) {
            Ok(i) => self.astral[i].2,
            Err(_) => self.none,
        }
    }
}

/// The end of the piece that whitespace at `i` starts under `\s*[\r\n]+|\s+(?!\S)|\s+`
/// (the last alternatives of both patterns), `is_space` being `\s`: the greedy `\s*` backs
/// off to the last line break of the run and `[\r\n]+` takes just that one (the run's
/// next character, if any, is not a line break); else `\s+(?!\S)` takes the whole run at
/// the end of the text, otherwise all of it but its last character (which then starts the
/// next piece) when that leaves any; else `\s+` the single character before a non-space.
pub(super) fn space_piece_end(s: &str, i: usize, is_space: impl Fn(char) -> bool) -> usize {
    let mut j = i;
    let mut last_start = i;
    let mut chars = 0usize;
    let mut after_break = None;
    while let Some((c, len)) = char_at(s, j) {
        if !is_space(c) {
            break;
        }
        if c == '\r' || c == '\n' {
            after_break = Some(j + len);
        }
        last_start = j;
        j += len;
        chars += 1;
    }
    if let Some(end) = after_break {
        return end;
    }
    if j == s.len() || chars == 1 {
        j
    } else {
        last_start
    }
}

/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)`: the case-insensitive variants of the contraction
/// letters `s t r e v m l d`, in that order (`s` also matches `S` and `ſ`), from
/// `regex-syntax`'s case folding.
pub(super) struct Contractions {
    folds: [Vec<char>; 8],
}

const FOLD_S: usize = 0;
const FOLD_T: usize = 1;
const FOLD_R: usize = 2;
const FOLD_E: usize = 3;
const FOLD_V: usize = 4;
const FOLD_M: usize = 5;
const FOLD_L: usize = 6;
const FOLD_D: usize = 7;

pub(super) fn unicode_class(pattern: &str) -> Result<Vec<(u32, u32)>, String> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(pattern)
        .map_err(|e| format!("cannot parse {pattern}: {e}"))?;
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(class)) => Ok(class
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect()),
        HirKind::Literal(lit) => {
            let c = std::str::from_utf8(&lit.0)
                .ok()
                .and_then(|s| s.chars().next())
                .ok_or_else(|| format!("{pattern} is not one character"))?;
            Ok(vec![(c as u32, c as u32)])
        }
        _ => Err(format!("{pattern} is not a character class")),
    }
}

impl Classes {
    pub(super) fn new() -> Result<Self, String> {
        let mut bmp = vec![Class::Other; 0x10000];
        let mut astral = Vec::new();
        for (pattern, class) in [
            (r"\p{L}", Class::Letter),
            (r"\p{N}", Class::Number),
            (r"\s", Class::Space),
        ] {
            for (lo, hi) in unicode_class(pattern)? {
                for u in lo..=hi.min(0xFFFF) {
                    if bmp[u as usize] != Class::Other {
                        return Err(format!("U+{u:04X} is in two classes"));
                    }
                    bmp[u as usize] = class;
                }
                if hi > 0xFFFF {
                    astral.push((lo.max(0x10000), hi, class));
                }
            }
        }
        astral.sort_unstable_by_key(|&(lo, hi, _)| (lo, hi));
        if astral.windows(2).any(|w| w[0].1 >= w[1].0) {
            return Err("overlapping astral classes".to_string());
        }
        Ok(Self {
            table: CodeTable::new(bmp, astral, Class::Other),
            contractions: Contractions::new()?,
        })
    }

    #[inline]
    fn of(&self, c: char) -> Class {
        self.table.get(c)
    }
}

impl Contractions {
    pub(super) fn new() -> Result<Self, String> {
        let mut folds: [Vec<char>; 8] = Default::default();
        for (slot, letter) in folds
            .iter_mut()
            .zip(['s', 't', 'r', 'e', 'v', 'm', 'l', 'd'])
        {
            for (lo, hi) in unicode_class(&format!("(?i:{letter})"))? {
                slot.extend((lo..=hi).filter_map(char::from_u32));
            }
        }
        Ok(Self { folds })
    }

    #[inline]
    fn folds(&self, c: Option<(char, usize)>, letter: usize) -> bool {
        c.is_some_and(|(c, _)| self.folds[letter].contains(&c))
    }

    /// The end of a contraction (`'s`, `'T`, `'re`, …) whose letters start at `i`, just
    /// after the apostrophe.
    pub(super) fn end(&self, s: &str, i: usize) -> Option<usize> {
        let c1 = char_at(s, i);
        let (_, l1) = c1?;
        if self.folds(c1, FOLD_S)
            || self.folds(c1, FOLD_T)
            || self.folds(c1, FOLD_M)
            || self.folds(c1, FOLD_D)
        {
            return Some(i + l1);
        }
        let c2 = char_at(s, i + l1);
        let two = (self.folds(c1, FOLD_R) && self.folds(c2, FOLD_E))
            || (self.folds(c1, FOLD_V) && self.folds(c2, FOLD_E))
            || (self.folds(c1, FOLD_L) && self.folds(c2, FOLD_L));
        match (two, c2) {
            (true, Some((_, l2))) => Some(i + l1 + l2),
            _ => None,
        }
    }
}

/// The character starting at byte `i` of `s` and its length in bytes.
#[inline]
pub(super) fn char_at(s: &str, i: usize) -> Option<(char, usize)> {
    let b = *s.as_bytes().get(i)?;
    if b < 0x80 {
        return Some((b as char, 1));
    }
    let c = s.get(i..)?.chars().next()?;
    Some((c, c.len_utf8()))
}

/// The end of `[\r\n]*` from `i`.
#[inline]
pub(super) fn skip_newlines(s: &str, mut i: usize) -> usize {
    let bytes = s.as_bytes();
    while i < bytes.len() && (bytes[i] == b'\r' || bytes[i] == b'\n') {
        i += 1;
    }
    i
}

impl Classes {
    /// The end of the run of `class` characters from `i`.
    #[inline]
    fn skip(&self, s: &str, mut i: usize, class: Class) -> usize {
        while let Some((c, len)) = char_at(s, i) {
            if self.of(c) != class {
                break;
            }
            i += len;
        }
        i
    }

    /// The end of the match of [`PATTERN`] that starts at byte `i` of `s` (`i < s.len()`,
    /// on a character boundary). Every character starts a match of one alternative and
    /// no alternative matches the empty string, so the result is always past `i`.
    pub(super) fn piece_end(&self, s: &str, i: usize) -> usize {
        let Some((c0, l0)) = char_at(s, i) else {
            return s.len();
        };
        let i1 = i + l0;
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c0 == '\'' {
            if let Some(end) = self.contractions.end(s, i1) {
                return end;
            }
        }
        let k0 = self.of(c0);
        let c1 = char_at(s, i1);
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if k0 == Class::Letter {
            return self.skip(s, i1, Class::Letter);
        }
        if k0 != Class::Number && c0 != '\r' && c0 != '\n' {
            if let Some((c1, l1)) = c1 {
                if self.of(c1) == Class::Letter {
                    return self.skip(s, i1 + l1, Class::Letter);
                }
            }
        }
        // \p{N}
        if k0 == Class::Number {
            return i1;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        if k0 == Class::Other {
            return skip_newlines(s, self.skip(s, i1, Class::Other));
        }
        if c0 == ' ' {
            if let Some((c1, l1)) = c1 {
                if self.of(c1) == Class::Other {
                    return skip_newlines(s, self.skip(s, i1 + l1, Class::Other));
                }
            }
        }
        // `c0` is whitespace from here.
        space_piece_end(s, i, |c| self.of(c) == Class::Space)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::byte_bpe::PROBES;

    fn pieces(text: &str) -> Vec<&str> {
        let classes = Classes::new().unwrap();
        let mut out = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let e = classes.piece_end(text, i);
            out.push(&text[i..e]);
            i = e;
        }
        out
    }

    /// The hand-written split cuts every probe and edge case where the regex matches.
    #[test]
    fn splits_like_the_regex() {
        let re = fancy_regex::Regex::new(PATTERN).unwrap();
        for text in PROBES.iter().copied().chain([
            "a  b",
            "a   \n b",
            "x \t\t",
            " \n",
            "\n \n  ",
            "'re're 're",
            "'",
            "''s",
            "!\n\n\r",
            " !a",
            "\t!",
            "1a",
            "a1",
            " 1",
            "_foo",
            "\u{301}a",
            "é\u{301}x",
        ]) {
            let want: Vec<&str> = re.find_iter(text).map(|m| m.unwrap().as_str()).collect();
            assert_eq!(pieces(text), want, "{text:?}");
        }
    }

    /// Every seventh code point falls in the class the regex gives it, and the fold of `s`
    /// includes the long s.
    #[test]
    fn classes_are_the_regex_classes() {
        let classes = Classes::new().unwrap();
        assert_eq!(classes.contractions.folds[FOLD_S], vec!['S', 's', 'ſ']);
        let letter = regex::Regex::new(r"^\p{L}$").unwrap();
        let number = regex::Regex::new(r"^\p{N}$").unwrap();
        let space = regex::Regex::new(r"^\s$").unwrap();
        for c in (0..0x11_0000u32).step_by(7).filter_map(char::from_u32) {
            let s = c.to_string();
            let want = if letter.is_match(&s) {
                Class::Letter
            } else if number.is_match(&s) {
                Class::Number
            } else if space.is_match(&s) {
                Class::Space
            } else {
                Class::Other
            };
            assert_eq!(classes.of(c), want, "U+{:04X}", c as u32);
        }
    }
}
