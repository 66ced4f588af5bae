//! Why a generation ended, as spool records it in the shard column `stop_reason` (read
//! from the server's answer by `run::ending`).
//!
//! Invariant: a generation is an end of turn ([`StopReason::ends_turn`]) only when the
//! model itself stopped — on its stop token, or with tool calls; a user's stop string, a
//! cut and an abort never are.

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

    /// Only the model's own stops end its turn.
    #[test]
    fn only_the_models_stops_end_its_turn() {
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
