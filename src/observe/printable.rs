//! Text from outside (dataset names from the store, servers' error messages, reports of
//! other processes) made safe to print on a terminal or into a log.
//!
//! Invariant: what [`escape`] returns holds no control character (C0, DEL, C1) and no
//! bidirectional override, so printed text cannot move the cursor, recolour or retitle the
//! terminal, reorder what is shown, or start a forged log line. Everything else is kept as
//! is, and text without such characters comes back borrowed.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` is shown escaped: controls, and the bidirectional embeddings, overrides and
/// isolates (U+202A–U+202E, U+2066–U+2069) that reorder what a terminal shows.
fn unsafe_char(c: char) -> bool {
    c.is_control()
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// `s` with every unsafe character written as an escape (`\n`, `\r`, `\t`, `\u{1b}`).
pub fn escape(s: &str) -> Cow<'_, str> {
    escape_except(s, &[])
}

/// As [`escape`], but the characters in `keep` are left as they are (`'\n'` for a
/// message of several lines that spool itself wrote).
pub fn escape_except<'a>(s: &'a str, keep: &[char]) -> Cow<'a, str> {
    if !s.chars().any(|c| unsafe_char(c) && !keep.contains(&c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !unsafe_char(c) || keep.contains(&c) {
            out.push(c);
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// As [`escape`], for a log line the formatter may have coloured: an SGR sequence (`ESC [`
/// digits and `;` then `m`, which only sets colours) is kept; any other escape sequence
/// and every other control is escaped. Tabs are kept.
pub fn escape_keeping_colours(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| unsafe_char(c) && c != '\t') {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut rest = s;
    while let Some(i) = rest.find('\u{1b}') {
        out.push_str(&escape_except(&rest[..i], &['\t']));
        let seq = &rest[i + 1..];
        let params = seq.strip_prefix('[').map(|p| {
            p.len()
                - p.trim_start_matches(|c: char| c.is_ascii_digit() || c == ';')
                    .len()
        });
        match params {
            Some(n) if seq[1 + n..].starts_with('m') => {
                out.push_str(&rest[i..i + 1 + 1 + n + 1]);
                rest = &rest[i + 1 + 1 + n + 1..];
            }
            _ => {
                out.push_str("\\u{1b}");
                rest = seq;
            }
        }
    }
    out.push_str(&escape_except(rest, &['\t']));
    Cow::Owned(out)
}

/// JSON text with DEL and the C1 controls written as `\u00XX` escapes (serde_json escapes
/// only C0), so a document printed on a terminal cannot drive it either. Same JSON value.
pub fn json_safe(json: String) -> String {
    if !json.chars().any(|c| ('\u{7f}'..='\u{9f}').contains(&c)) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if ('\u{7f}'..='\u{9f}').contains(&c) {
            let _ = write!(out, "\\u{:04x}", c as u32);
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Terminal escapes, line breaks, C1 controls and bidi overrides are written out;
    /// ordinary text (accents, CJK, emoji) is untouched and not copied.
    #[test]
    fn controls_are_escaped_and_text_is_kept() {
        assert_eq!(
            escape("a\u{1b}]0;pwned\u{7}b\r\nc\u{9b}d\u{202e}e"),
            "a\\u{1b}]0;pwned\\u{7}b\\r\\nc\\u{9b}d\\u{202e}e"
        );
        assert!(matches!(escape("héllo 世界 🦀"), Cow::Borrowed(_)));
        assert_eq!(escape_except("a\nb\u{1b}", &['\n']), "a\nb\\u{1b}");
    }

    /// Colour sequences of a log line are kept; a screen clear, a title change, a line
    /// break and a carriage return are escaped.
    #[test]
    fn log_lines_keep_colours_only() {
        let line =
            "\u{1b}[2m2026\u{1b}[0m \u{1b}[33mWARN\u{1b}[0m bad\u{1b}[2J\u{1b}]0;t\u{7}\r\nx\tz";
        assert_eq!(
            escape_keeping_colours(line),
            "\u{1b}[2m2026\u{1b}[0m \u{1b}[33mWARN\u{1b}[0m bad\\u{1b}[2J\\u{1b}]0;t\\u{7}\\r\\nx\tz"
        );
        assert_eq!(escape_keeping_colours("\u{1b}"), "\\u{1b}");
        assert_eq!(escape_keeping_colours("a\u{1b}[31"), "a\\u{1b}[31");
    }

    /// The JSON form keeps the value: DEL and C1 become `\u` escapes that parse back.
    #[test]
    fn json_keeps_its_value() {
        let v = serde_json::json!({"name": "x\u{9b}31m\u{7f}\u{1b}"});
        let text = json_safe(serde_json::to_string(&v).unwrap());
        assert!(text.chars().all(|c| !c.is_control()), "{text:?}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).unwrap(), v);
    }
}
