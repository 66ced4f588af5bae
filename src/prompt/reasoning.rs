//! Thinking in raw text: the markers a chat template wraps it in, and the split of a raw
//! completion into its reasoning and its answer (the token ids stay whole).

use super::ChatTemplate;

/// The markers around a model's thinking (`<think>` / `</think>` for Qwen3 and
/// DeepSeek-R1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkMarkers {
    pub open: String,
    pub close: String,
}

impl ThinkMarkers {
    /// The markers `template` uses, if it has any.
    pub fn of_template(_template: &ChatTemplate) -> Option<ThinkMarkers> {
        unimplemented!("of_template")
    }

    /// (reasoning, answer) of a raw completion. Thinking cut off before its close marker
    /// is all reasoning; a completion without markers is all answer.
    pub fn split(&self, _text: &str) -> (Option<String>, String) {
        unimplemented!("split")
    }
}
