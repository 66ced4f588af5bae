//! Why a generation ended, from what its server said: the finish reason read together with
//! the stop it named (SGLang's `matched` / `matched_stop`, vLLM's `stop_reason`) and the
//! stop strings the request carried.
//!
//! Invariant: when the server does not say which stop matched and the request carried
//! stop strings, the reason is unknown (`None`), never guessed.

use crate::store::stop_reason::StopReason;
use crate::upstream::Matched;

/// The reason of a generation that finished with `finish_reason` and `matched`, sent
/// with `stop_strings`; `None` when that does not tell (a `stop` with stop strings sent
/// and no match named, or a finish reason spool does not know).
pub fn stop_reason(
    finish_reason: &str,
    matched: &Matched,
    stop_strings: &[String],
) -> Option<StopReason> {
    match finish_reason {
        "length" => Some(StopReason::Length),
        "abort" => Some(StopReason::Abort),
        "tool_calls" => Some(StopReason::ToolCalls),
        "stop" => match matched {
            Matched::Token(id) => Some(StopReason::Eos(Some(*id))),
            Matched::Text(s) => Some(StopReason::StopString(s.clone())),
            Matched::Null => Some(StopReason::Eos(None)),
            // Only the model's stop token can have stopped it.
            Matched::Unsaid if stop_strings.is_empty() => Some(StopReason::Eos(None)),
            Matched::Unsaid => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each server's way of saying why it stopped becomes one reason: a named token is the
    /// model's stop, a named string the user's stop string, vLLM's null the model's EOS;
    /// a server that names nothing is the model's stop only when no stop string was sent.
    #[test]
    fn reasons_follow_what_the_server_named() {
        let none: Vec<String> = Vec::new();
        let some = vec!["</answer>".to_string()];
        let cases = [
            (
                "stop",
                Matched::Token(151645),
                &none,
                Some(StopReason::Eos(Some(151645))),
            ),
            (
                "stop",
                Matched::Token(151645),
                &some,
                Some(StopReason::Eos(Some(151645))),
            ),
            (
                "stop",
                Matched::Text("</answer>".into()),
                &some,
                Some(StopReason::StopString("</answer>".into())),
            ),
            ("stop", Matched::Null, &some, Some(StopReason::Eos(None))),
            ("stop", Matched::Unsaid, &none, Some(StopReason::Eos(None))),
            ("stop", Matched::Unsaid, &some, None),
            ("length", Matched::Unsaid, &some, Some(StopReason::Length)),
            ("length", Matched::Null, &none, Some(StopReason::Length)),
            (
                "tool_calls",
                Matched::Null,
                &none,
                Some(StopReason::ToolCalls),
            ),
            ("abort", Matched::Unsaid, &none, Some(StopReason::Abort)),
            ("content_filter", Matched::Unsaid, &none, None),
        ];
        for (finish, matched, stops, want) in cases {
            assert_eq!(
                stop_reason(finish, &matched, stops),
                want,
                "{finish} {matched:?}"
            );
        }
    }
}
