//! `speculators`: JSONL, one line per generation, in the shape vllm-project/speculators'
//! `regenerate-responses` writes and `prepare-data` takes as pre-tokenized rows:
//! `{"id", "primary_id", "input_ids", "loss_mask", "text", "metadata"}`.
//!
//! - `primary_id` is `<item id>_s<sample>`: in speculators a primary id names one
//!   conversation, and each sample of a spool item is its own conversation (its own
//!   generated history). `id` is `<primary_id>_gen<turn>`: the turn is the number of
//!   replies generated before this one in that conversation, which is what speculators'
//!   `_gen<k>` counts. Ids are unique per dataset (as the item ids are).
//! - `input_ids` = prompt ids ++ completion ids (end-of-turn id included, see
//!   [`super::rows`]); `loss_mask` 0 per prompt id, 1 per completion id.
//! - `text` is `input_ids` decoded with special tokens kept — the prompt and completion
//!   as the model saw them, as speculators writes it (review only; training reads the
//!   ids). Without a `[tokenizer]` it is the stored prompt text followed by the completion.
//! - `metadata` has the same keys with the same JSON types on every line: `datasets`
//!   fixes a JSON file's schema from its first chunk, so a key that appears later, or a
//!   null that later becomes a string, fails the load. Hence `partial` is `""` when the
//!   conversation was complete and `sampling` is a JSON string (the dataset's sampling
//!   from the config, with what was drawn for this row over it).

use super::{Accounting, ExportContext, ExportRow, Jsonl, Sink};
use crate::config::Sampling;
use crate::output::export::error::{Context, ExportError, Result};
use crate::prompt::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The `speculators` writer.
struct SpeculatorsSink {
    out: Jsonl,
    tokenizer: Option<Tokenizer>,
    sampling: BTreeMap<String, Sampling>,
}

/// One row per generation in speculators' shape.
pub fn sink(tmp: &Path, ctx: &ExportContext) -> Result<Box<dyn Sink>> {
    Ok(Box::new(SpeculatorsSink {
        out: Jsonl::create(tmp)?,
        tokenizer: ctx.tokenizer.clone(),
        sampling: ctx.sampling.clone(),
    }))
}

impl Sink for SpeculatorsSink {
    fn push(&mut self, row: &ExportRow) -> Result<()> {
        // The gates leave out rows without ids for this format.
        let Some((ids, mask)) = row.ids_and_mask() else {
            return Ok(());
        };
        let r = &row.row;
        let text = match &self.tokenizer {
            Some(t) => t
                .decode(&ids)
                .with_context(|| format!("item `{}`: cannot decode its ids", r.id))?,
            None => format!("{}{}", r.prompt, r.completion),
        };
        let sampling = sampling_json(self.sampling.get(&r.dataset), r.sampling.as_deref())
            .with_context(|| format!("item `{}`: stored sampling is not a JSON object", r.id))?;
        self.out
            .line(&speculators_line(row, &ids, &mask, text, sampling))
    }

    fn finish(self: Box<Self>, _: &Accounting) -> Result<()> {
        self.out.finish()
    }
}

/// The conversation key of a row: `<item id>_s<sample>`.
pub fn primary_id(row: &ExportRow) -> String {
    format!("{}_s{}", row.row.id, row.row.sample)
}

/// What generated a row, as one JSON object text: the dataset's configured sampling
/// (`config`), with the values drawn for the row (`drawn`, the row's `sampling` column)
/// over it.
pub fn sampling_json(config: Option<&Sampling>, drawn: Option<&str>) -> Result<String> {
    let mut m = match config.map(serde_json::to_value).transpose()? {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    if let Some(d) = drawn {
        match serde_json::from_str::<Value>(d)? {
            Value::Object(o) => m.extend(o),
            other => {
                return Err(ExportError::broken(format!(
                    "expected an object, not {other}"
                )))
            }
        }
    }
    Ok(Value::Object(m).to_string())
}

/// One `speculators` line for `row` with its `ids`/`mask` (from [`ExportRow::ids_and_mask`]).
pub fn speculators_line(
    row: &ExportRow,
    ids: &[u32],
    mask: &[u8],
    text: String,
    sampling: String,
) -> Value {
    let r = &row.row;
    let primary = primary_id(row);
    json!({
        "id": format!("{primary}_gen{}", r.turn),
        "primary_id": primary,
        "input_ids": ids,
        "loss_mask": mask,
        "text": text,
        "metadata": {
            "dataset": r.dataset,
            "idx": r.row,
            "sample": r.sample,
            "turn": r.turn,
            "finish_reason": r.finish_reason,
            "is_tool_call": r.tool_calls.is_some(),
            "partial": r.partial.as_deref().unwrap_or(""),
            "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens},
            "model": r.model,
            "sampling": sampling,
            "count_source": &*row.count_source,
            "end_of_turn_appended": row.end_of_turn_appended,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::{prepare, EndOfTurn};
    use crate::store::row::ShardRow;

    fn row(finish: &str, sample: u32, turn: u32) -> ExportRow {
        let eot = EndOfTurn {
            id: 9,
            token: "<|im_end|>".into(),
            source: "test".into(),
            after_tool_call: None,
        };
        prepare(
            ShardRow {
                id: "q1".into(),
                dataset: "d".into(),
                row: 4,
                prompt_token_ids: Some(vec![1, 2]),
                completion_token_ids: Some(vec![5, 6]),
                prompt_tokens: 2,
                completion_tokens: 2,
                finish_reason: finish.into(),
                model: "m".into(),
                sample,
                turn,
                ..ShardRow::default()
            },
            "server".into(),
            Some(&eot),
        )
    }

    fn line(r: &ExportRow, sampling: &str) -> Value {
        let (ids, mask) = r.ids_and_mask().unwrap();
        speculators_line(r, &ids, &mask, "t".into(), sampling.into())
    }

    /// A line carries prompt ++ completion ids (end-of-turn appended) with the 0/1 mask,
    /// the conversation key of its sample and the generation index of its turn.
    #[test]
    fn a_line_is_speculators_row_shape() {
        let v = line(&row("stop", 1, 2), "{}");
        assert_eq!(v["id"], "q1_s1_gen2");
        assert_eq!(v["primary_id"], "q1_s1");
        assert_eq!(v["input_ids"], json!([1, 2, 5, 6, 9]));
        assert_eq!(v["loss_mask"], json!([0, 0, 1, 1, 1]));
        assert_eq!(v["text"], "t");
        let m = &v["metadata"];
        assert_eq!(m["finish_reason"], "stop");
        assert_eq!(m["end_of_turn_appended"], true);
        assert_eq!(m["count_source"], "server");
        assert_eq!(m["idx"], 4);
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "id",
                "primary_id",
                "input_ids",
                "loss_mask",
                "text",
                "metadata"
            ]
        );
    }

    /// Rows of different kinds (partial or not, tool call or not, appended or not) have
    /// the same metadata keys with the same JSON types and no null, so `datasets` loads
    /// a file whatever row comes first.
    #[test]
    fn metadata_keys_and_types_never_vary() {
        fn shape(v: &Value) -> Vec<(String, &'static str)> {
            v["metadata"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let t = match v {
                        Value::Null => "null",
                        Value::Bool(_) => "bool",
                        Value::Number(_) => "number",
                        Value::String(_) => "string",
                        Value::Array(_) => "array",
                        Value::Object(_) => "object",
                    };
                    (k.clone(), t)
                })
                .collect()
        }
        let plain = line(&row("stop", 0, 0), r#"{"temperature":0.6}"#);
        let mut odd = row("length", 1, 1);
        odd.row.partial = Some("budget".into());
        odd.row.tool_calls = Some("[]".into());
        let odd = line(&odd, r#"{"temperature":1.0,"seed":3}"#);
        assert_eq!(shape(&plain), shape(&odd));
        assert!(shape(&plain).iter().all(|(_, t)| *t != "null"));
        assert_eq!(plain["metadata"]["partial"], "");
        assert_eq!(odd["metadata"]["partial"], "budget");
        assert_eq!(odd["metadata"]["is_tool_call"], true);
    }

    /// The recorded sampling is the dataset's config with the row's drawn values over
    /// it; stored sampling that is not an object is an error.
    #[test]
    fn sampling_is_the_config_with_the_draw_over_it() {
        let cfg = Sampling {
            max_tokens: 100,
            temperature: 0.6,
            top_p: 0.95,
            top_k: Some(20),
            ..Sampling::default()
        };
        let s = sampling_json(Some(&cfg), Some(r#"{"temperature":1.0,"seed":7}"#)).unwrap();
        let v: Value = serde_json::from_str(&s).unwrap();
        assert_eq!(
            v,
            json!({"max_tokens": 100, "temperature": 1.0, "top_p": 0.95, "top_k": 20, "seed": 7})
        );
        assert_eq!(sampling_json(None, None).unwrap(), "{}");
        assert!(sampling_json(Some(&cfg), Some("[1]")).is_err());
    }
}
