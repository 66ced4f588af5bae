//! The completed-row record: what an answered item becomes, from the worker that builds it
//! through the results log to the shard that holds it.
//!
//! It is defined in the store, not beside the Parquet writer, because the store keeps it
//! durably first; the output stage reads it from here, so dependencies point one way.
//!
//! Invariant: its field order and serde names are a compatibility boundary (the results
//! log's binary records and format-2 queues' JSON records are read back by them).

/// One completed item: the result the queue keeps in its results log until the archive
/// writes it as a row of a shard ([`encode_row`](crate::store::results::encode_row): its
/// field order is a compatibility boundary, as are the serde field names, which format-2
/// queues stored as JSON and the migration reads).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardRow {
    /// Item id: the input row's `id`, or one derived from its content when it has none.
    pub id: String,
    /// Dataset name.
    pub dataset: String,
    /// 0-based row index in the input file.
    pub row: u64,
    /// The exact text sent, after the chat template.
    pub prompt: String,
    /// Input messages as JSON text, when the input row had messages or conversations.
    pub messages: Option<String>,
    /// Prompt token ids (None without a tokenizer).
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Generated text.
    pub completion: String,
    /// Generated token ids, from the server or the tokenizer.
    pub completion_token_ids: Option<Vec<u32>>,
    /// Prompt token count.
    pub prompt_tokens: u32,
    /// Completion token count; this is what budgets count.
    pub completion_tokens: u32,
    /// `stop`, `length`, … as the server said.
    pub finish_reason: String,
    /// Model name.
    pub model: String,
    /// Requests it took.
    pub attempts: u32,
    /// Last attempt, request to last byte.
    pub latency_ms: u32,
    /// Time to first token (streaming only).
    pub ttft_ms: Option<u32>,
    /// Unix ms UTC; column `completed_at`, timestamp(ms, "UTC").
    pub completed_at_ms: i64,
    /// Which of the dataset's `samples` generations of this prompt (0-based).
    #[serde(default)]
    pub sample: u32,
    /// The generated assistant turn's place in the conversation: how many assistant
    /// replies come before it (0 for a single-turn prompt).
    #[serde(default)]
    pub turn: u32,
    /// The model's thinking, apart from `completion` (None when it had none or
    /// `reasoning = "raw"` left it in the text).
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Generated tool calls, as OpenAI's `tool_calls` JSON array.
    #[serde(default)]
    pub tool_calls: Option<String>,
    /// The tools offered (OpenAI function schemas, JSON array), when the row had them.
    #[serde(default)]
    pub tools: Option<String>,
    /// What was sent besides the prompt and drawn per row (JSON object: sampling
    /// parameters, `chat_template_kwargs`, the seed).
    #[serde(default)]
    pub sampling: Option<String>,
    /// Why this generation's conversation ended before its last turn (`budget`,
    /// `tool_mismatch: …`, `failed: …`); None when every turn was generated.
    #[serde(default)]
    pub partial: Option<String>,
    /// Who rendered `prompt_token_ids`: spool, or the server (its rendering endpoint, or
    /// the prompt ids of its chat answer); None when there are none.
    #[serde(default)]
    pub prompt_ids_source: Option<crate::prompt::remote::IdsSource>,
}

#[cfg(test)]
impl ShardRow {
    /// A minimal finished row for tests of the modules that carry rows (queue, archive,
    /// verify); tests set what they check with struct-update syntax.
    pub(crate) fn for_tests(id: String, dataset: &str, row: u64) -> Self {
        Self {
            id,
            dataset: dataset.into(),
            row,
            prompt: "p".into(),
            messages: None,
            prompt_token_ids: None,
            completion: "c".into(),
            completion_token_ids: None,
            prompt_tokens: 1,
            completion_tokens: 0,
            finish_reason: "stop".into(),
            model: "m".into(),
            attempts: 1,
            latency_ms: 1,
            ttft_ms: None,
            completed_at_ms: 0,
            sample: 0,
            turn: 0,
            reasoning: None,
            tool_calls: None,
            tools: None,
            sampling: None,
            partial: None,
            prompt_ids_source: None,
        }
    }
}
