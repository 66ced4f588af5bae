//! The reasoning split of SGLang's `BaseReasoningFormatDetector.detect_and_parse`, which
//! its `kimi_k2`, `deepseek-r1`, `deepseek-v3`, `glm45`, `qwen3` and `minimax` parsers
//! share, each with its own markers, tool-start token and forcing.
//!
//! Invariant: reasoning plus answer is the text less the markers the detector removes
//! (leading open markers, the first close marker) and, unlike SGLang, whitespace before a
//! leading open marker: GLM writes `\n<think>` and re-renders `\n<think>` + the stripped
//! reasoning, so SGLang's `\n<think>…` reasoning would come back as `<think><think>`
//! (vLLM drops that prefix too). Nothing else is trimmed.

/// One parser's markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkBlock {
    pub open: &'static str,
    pub close: &'static str,
    /// A token that ends thinking without a close marker (kept in the answer).
    pub tool_start: Option<&'static str>,
    /// The parser treats text as thinking from its start (DeepSeek-R1, MiniMax).
    pub always_forced: bool,
}

impl ThinkBlock {
    /// (reasoning, answer); `forced`: the prompt already opened the thinking block.
    pub fn split(&self, text: &str, forced: bool) -> (Option<String>, String) {
        let in_reasoning = forced || self.always_forced || text.contains(self.open);
        if !in_reasoning {
            return (None, text.to_owned());
        }
        let mut rest = match text.trim_start() {
            t if t.starts_with(self.open) => t,
            _ => text,
        };
        while let Some(r) = rest.strip_prefix(self.open) {
            rest = r;
        }
        match rest.find(self.close) {
            Some(at) => (
                Some(rest[..at].to_owned()),
                rest[at + self.close.len()..].to_owned(),
            ),
            None => match self.tool_start.and_then(|t| rest.find(t)) {
                Some(at) => (Some(rest[..at].to_owned()), rest[at..].to_owned()),
                None => (Some(rest.to_owned()), String::new()),
            },
        }
    }
}
