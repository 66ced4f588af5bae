//! On-policy conversations: turn k of a conversation is requested after the *generated*
//! replies of turns 0..k, never the source's own assistant turns.
//!
//! Invariant: a request for turn k holds the source's system prompt, its user turns up to
//! k, the k replies generated before it and the tool results cached in the source that
//! follow a generated tool call matching them (by order and name); at the first mismatch
//! the conversation stops, with the reason.

use crate::config::HistoryReasoning;
use serde_json::Value;

/// One generated assistant reply, as later turns' histories hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub content: String,
    pub reasoning: Option<String>,
    /// OpenAI `tool_calls` array.
    pub tool_calls: Option<Value>,
}

/// A source conversation with every message kept (assistant turns included), as a
/// `turns = "all"` item stores it.
#[derive(Debug, Clone)]
pub struct Conversation {
    #[allow(dead_code)] // read once the turns are built
    messages: Vec<Value>,
}

impl Conversation {
    /// The conversation of an item's stored messages.
    pub fn new(messages: Vec<Value>) -> Conversation {
        Conversation { messages }
    }

    /// How many assistant turns are generated: one per assistant message, and one more
    /// when the conversation ends with a user (or tool) message.
    pub fn turns(&self) -> u32 {
        unimplemented!("conversation turns")
    }

    /// Turn `k`'s request messages, given the `k` replies generated before it; `Err` says
    /// why the conversation stops before turn `k` (a tool call that does not match the
    /// cached result).
    pub fn request(
        &self,
        _k: u32,
        _earlier: &[Reply],
        _history: HistoryReasoning,
    ) -> Result<Vec<Value>, String> {
        unimplemented!("conversation request")
    }
}
