//! Why a generation ended, as spool records it in the shard column `stop_reason`: the
//! server's finish reason read together with the stop it named (SGLang's `matched` /
//! `matched_stop`, vLLM's `stop_reason`) and the stop strings the request carried.
//!
//! Invariant: a generation is an end of turn ([`StopReason::ends_turn`]) only when the
//! model itself stopped — on its stop token, or with tool calls; a user's stop string, a
//! cut and an abort never are. When the server does not say which stop matched and the
//! request carried stop strings, the reason is unknown (`None`), never guessed.

use crate::upstream::Matched;

/// Why one generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The model emitted its stop token (EOS, end of turn): its id when the server named
    /// it. Column text `eos`, or `eos:<id>`.
    Eos(Option<u32>),
    /// One of the request's `stop` strings matched (which one). Column text `stop:<string>`.
    StopString(String),
    /// The chat API ended the turn with tool calls (`finish_reason` `tool_calls`).
    ToolCalls,
    /// Cut by `max_tokens` or the context.
    Length,
    /// The server aborted the generation.
    Abort,
}

impl StopReason {
    /// The reason of a generation that finished with `finish_reason` and `matched`, sent
    /// with `stop_strings`; `None` when that does not tell (a `stop` with stop strings sent
    /// and no match named, or a finish reason spool does not know).
    pub fn of(finish_reason: &str, matched: &Matched, stop_strings: &[String]) -> Option<Self> {
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

    /// Whether the model ended its turn itself (its stop token, or tool calls).
    pub fn ends_turn(&self) -> bool {
        matches!(self, StopReason::Eos(_) | StopReason::ToolCalls)
    }

    /// The column's text.
    pub fn to_text(&self) -> String {
        match self {
            StopReason::Eos(None) => "eos".into(),
            StopReason::Eos(Some(id)) => format!("eos:{id}"),
            StopReason::StopString(s) => format!("stop:{s}"),
            StopReason::ToolCalls => "tool_calls".into(),
            StopReason::Length => "length".into(),
            StopReason::Abort => "abort".into(),
        }
    }

    /// Reads the column's text back; `None` for text spool does not write.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "eos" => StopReason::Eos(None),
            "tool_calls" => StopReason::ToolCalls,
            "length" => StopReason::Length,
            "abort" => StopReason::Abort,
            t => match t.split_once(':') {
                Some(("eos", id)) if !id.starts_with('+') => {
                    StopReason::Eos(Some(id.parse().ok()?))
                }
                Some(("stop", s)) => StopReason::StopString(s.to_string()),
                _ => return None,
            },
        })
    }
}

/// Written as the column's text, so a row's JSON holds what its shard holds.
impl serde::Serialize for StopReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_text())
    }
}

impl<'de> serde::Deserialize<'de> for StopReason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        StopReason::parse(&text)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown stop reason {text:?}")))
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
                StopReason::of(finish, &matched, stops),
                want,
                "{finish} {matched:?}"
            );
        }
        assert!(StopReason::Eos(None).ends_turn() && StopReason::ToolCalls.ends_turn());
        assert!(!StopReason::StopString("x".into()).ends_turn());
        assert!(!StopReason::Length.ends_turn() && !StopReason::Abort.ends_turn());
    }

    /// The column text reads back as the reason it was written from (a stop string may hold
    /// anything, colons included); other text is refused.
    #[test]
    fn the_column_text_round_trips() {
        for r in [
            StopReason::Eos(None),
            StopReason::Eos(Some(7)),
            StopReason::StopString("a:b\n".into()),
            StopReason::StopString(String::new()),
            StopReason::ToolCalls,
            StopReason::Length,
            StopReason::Abort,
        ] {
            assert_eq!(StopReason::parse(&r.to_text()), Some(r.clone()), "{r:?}");
        }
        for bad in [
            "",
            "stop",
            "eos:",
            "eos:x",
            "eos:+1",
            "eos:4294967296",
            "other:1",
        ] {
            assert_eq!(StopReason::parse(bad), None, "{bad:?}");
        }
    }
}
