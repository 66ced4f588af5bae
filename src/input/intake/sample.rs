//! The rows the start-up template check compares, sampled from the start of a dataset:
//! the first few good ones, then one with each feature a template treats apart.
//!
//! Invariant: a sampled row is rendered exactly as intake would render it (the same
//! [`stage`](super::render::stage)); rows intake sends unrendered or rejects are left out.

use super::render::{stage, Planned};
use super::{IntakeError, IntakeOptions};
use crate::config::DatasetConfig;
use crate::input::dataset::DatasetReader;
use crate::input::row::{Entry, Row};
use crate::prompt::remote::RenderInput;
use crate::prompt::PromptBuilder;
use serde_json::Value;

/// Good rows the start-up template check compares, read from the start of a dataset.
pub const CHECK_ROWS: usize = 8;
/// Lines read at most to find them.
pub const CHECK_SCAN: u64 = 2_000;

/// A row of a dataset and what its prompt is made of, for the start-up template check.
#[derive(Debug, Clone)]
pub struct SampledRow {
    /// 1-based line (Parquet: row number).
    pub line: u64,
    pub id: String,
    pub input: RenderInput,
}

/// The rows the start-up template check compares: among the first [`CHECK_SCAN`] lines of
/// `d`, the first three good rows, then the first row with each of: tools, a system
/// prompt, an earlier assistant turn, a tool result, reasoning in an earlier turn — at
/// most [`CHECK_ROWS`]. Each is what intake would render (turn 0's request with `turns =
/// "all"`, the dataset's fixed variables, the row's tools). Rows intake sends unrendered
/// or would reject are left out.
pub fn sample_rows(
    d: &DatasetConfig,
    builder: &PromptBuilder,
    opts: &IntakeOptions,
) -> Result<Vec<SampledRow>, IntakeError> {
    let mut reader = DatasetReader::open(opts.file_of(d), &d.name)?;
    let (parser, render) = stage(&reader, d, opts, builder)?;
    let mut picked: Vec<SampledRow> = Vec::new();
    let mut covered = [false; 5];
    while let Some(raw) = reader.next_raw()? {
        let line = raw.line();
        if line > CHECK_SCAN || picked.len() >= CHECK_ROWS {
            break;
        }
        let Entry::Row(row) = parser.parse(raw) else {
            continue;
        };
        let row = render.shaped(row);
        let Ok(Planned::Input(input)) = render.plan(builder, &row, false) else {
            continue;
        };
        let features = features_of(&row, &input);
        let new = features.iter().zip(&covered).any(|(f, c)| *f && !c);
        if picked.len() < 3 || new {
            for (c, f) in covered.iter_mut().zip(features) {
                *c |= f;
            }
            picked.push(SampledRow {
                line,
                id: row.id,
                input,
            });
        }
    }
    Ok(picked)
}

/// Which of the features [`sample_rows`] looks for a row has: tools, a system prompt, an
/// earlier assistant turn, a tool result, reasoning in an earlier turn.
fn features_of(row: &Row, input: &RenderInput) -> [bool; 5] {
    let RenderInput::Chat { messages, .. } = input else {
        return [false; 5];
    };
    let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
    let role = |r: &str| {
        list.iter()
            .any(|m| m.get("role").and_then(Value::as_str) == Some(r))
    };
    let reasoning = list.iter().any(|m| {
        ["reasoning_content", "reasoning"]
            .iter()
            .any(|k| m.get(*k).is_some_and(|v| !v.is_null()))
    });
    [
        row.tools.is_some(),
        role("system"),
        role("assistant"),
        role("tool"),
        reasoning,
    ]
}
