//! Quality gates and the export's accounting: which rows go out, and a count of every
//! row and item that does not.
//!
//! Invariants, checked at the end of every export (a failure is an error, not a warning):
//! - per dataset, `kept + dropped (all reasons) = rows read` from the sealed shards;
//! - per dataset, `items in sealed shards + done but not yet sealed + failed + rejected +
//!   not done = input rows`, with the queue's counts; when the queue's report comes from a
//!   stopped run, the items found in the shards must be exactly the queue's sharded items.

use super::{ExportRow, Format};
use crate::output::export::error::{ExportError, Result};
use crate::prompt::reasoning::ThinkMarkers;
use crate::store::report::StatusReport;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

/// What to do with an answer that still holds think markers after its thinking was split.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ThinkGate {
    /// Keep the row and count it (and say so in formats with metadata).
    #[default]
    Flag,
    /// Leave the row out.
    Drop,
    /// Keep the row without looking.
    Keep,
}

/// Which rows an export keeps.
#[derive(Debug, Clone, Serialize)]
pub struct Gates {
    /// Finish reasons whose rows are left out (default none: every finished generation is
    /// kept, truncated ones marked).
    pub exclude_finish: Vec<String>,
    /// Keep completions with no text, no thinking and no tool call (default: dropped).
    pub keep_empty: bool,
    pub think: ThinkGate,
    #[serde(skip)]
    pub markers: ThinkMarkers,
}

impl Default for Gates {
    fn default() -> Self {
        Gates {
            exclude_finish: Vec::new(),
            keep_empty: false,
            think: ThinkGate::Flag,
            markers: ThinkMarkers {
                open: "<think>".into(),
                close: "</think>".into(),
            },
        }
    }
}

impl Gates {
    /// The gates in one line, so an export's output says what it kept by default.
    pub fn describe(&self) -> String {
        let finish = if self.exclude_finish.is_empty() {
            "keep every finish reason (cut rows marked; `--exclude-finish length` drops them)"
                .to_string()
        } else {
            format!("drop finish reasons {}", self.exclude_finish.join(", "))
        };
        let empty = if self.keep_empty { "keep" } else { "drop" };
        let think = match self.think {
            ThinkGate::Flag => "flag",
            ThinkGate::Drop => "drop",
            ThinkGate::Keep => "keep",
        };
        format!("gates: {finish}; {empty} empty completions; {think} leftover think markers")
    }

    /// Why `row` is left out, or None to keep it. Sets `row.leftover_think`.
    pub fn verdict(&self, format: Format, row: &mut ExportRow) -> Option<String> {
        let r = &row.row;
        if self.exclude_finish.contains(&r.finish_reason) {
            return Some(format!("finish_reason={}", r.finish_reason));
        }
        let empty = r.completion.trim().is_empty()
            && r.reasoning.as_deref().is_none_or(|t| t.trim().is_empty())
            && r.tool_calls.is_none();
        if empty && !self.keep_empty {
            return Some("empty".into());
        }
        if format.needs_ids() && (r.prompt_token_ids.is_none() || r.completion_token_ids.is_none())
        {
            return Some("no_token_ids".into());
        }
        if r.reasoning.is_some()
            && self.think != ThinkGate::Keep
            && (r.completion.contains(&self.markers.open)
                || r.completion.contains(&self.markers.close))
        {
            if self.think == ThinkGate::Drop {
                return Some("leftover_think_markers".into());
            }
            row.leftover_think = true;
        }
        None
    }
}

/// The queue's counts for one dataset, for the item-level identity.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QueueCounts {
    /// `queue` (a stopped run) or `endpoint` (a running one).
    pub source: String,
    pub input_rows: u64,
    pub items: u64,
    pub done: u64,
    pub sharded: u64,
    pub failed: u64,
    pub rejected: u64,
    pub not_done: u64,
}

/// One dataset's count.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DatasetAccount {
    pub dataset: String,
    /// Generations read from sealed shards.
    pub rows_in: u64,
    pub kept: u64,
    /// Left out, by reason.
    pub dropped: BTreeMap<String, u64>,
    /// Kept but marked, by reason.
    pub flagged: BTreeMap<String, u64>,
    /// Kept rows whose ids got the end-of-turn id appended.
    pub end_of_turn_appended: u64,
    /// Kept rows cut by `max_tokens`.
    pub truncated_kept: u64,
    /// Completion tokens of the kept rows (as counted by the run).
    pub kept_completion_tokens: u64,
    /// Distinct items in the sealed shards.
    pub items_in_shards: u64,
    /// Items with at least one kept row.
    pub items_kept: u64,
    /// The queue's counts, when the queue or the running process answered.
    pub queue: Option<QueueCounts>,
    /// Kept rows held out for evaluation (`--holdout`), and their items.
    pub eval_rows: u64,
    pub eval_items: u64,
    #[serde(skip)]
    last_id: Option<String>,
    #[serde(skip)]
    last_eval_id: Option<String>,
    #[serde(skip)]
    item_kept: bool,
}

impl DatasetAccount {
    fn dropped_total(&self) -> u64 {
        self.dropped.values().sum()
    }
}

/// Every row and item of one export, counted.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Accounting {
    pub format: String,
    pub gates: Option<Gates>,
    pub datasets: Vec<DatasetAccount>,
    /// The fraction of items held out for evaluation (`--holdout`), if any.
    pub holdout: Option<f64>,
    /// True once [`Accounting::finish`] checked the identities.
    pub checked: bool,
}

impl Accounting {
    pub fn new(format: Format, gates: &Gates) -> Self {
        Accounting {
            format: format.name().into(),
            gates: Some(gates.clone()),
            datasets: Vec::new(),
            holdout: None,
            checked: false,
        }
    }

    pub fn begin_dataset(&mut self, name: &str) {
        self.datasets.push(DatasetAccount {
            dataset: name.into(),
            ..Default::default()
        });
    }

    /// Counts `row` and returns it when the gates keep it.
    pub fn judge(
        &mut self,
        gates: &Gates,
        format: Format,
        mut row: ExportRow,
    ) -> Option<ExportRow> {
        let verdict = gates.verdict(format, &mut row);
        let d = self.datasets.last_mut()?;
        d.rows_in += 1;
        if d.last_id.as_deref() != Some(row.row.id.as_str()) {
            d.items_in_shards += 1;
            d.last_id = Some(row.row.id.clone());
            d.item_kept = false;
        }
        match verdict {
            Some(reason) => {
                *d.dropped.entry(reason).or_default() += 1;
                None
            }
            None => {
                d.kept += 1;
                d.kept_completion_tokens += u64::from(row.row.completion_tokens);
                if !d.item_kept {
                    d.item_kept = true;
                    d.items_kept += 1;
                }
                if row.end_of_turn_appended {
                    d.end_of_turn_appended += 1;
                }
                if row.truncated() {
                    d.truncated_kept += 1;
                }
                if row.leftover_think {
                    *d.flagged
                        .entry("leftover_think_markers".into())
                        .or_default() += 1;
                }
                if row.end_of_turn_unknown {
                    *d.flagged.entry("end_of_turn_unknown".into()).or_default() += 1;
                }
                Some(row)
            }
        }
    }

    /// Counts a kept row that goes to the eval split (rows of an item come together).
    pub fn hold_out(&mut self, row: &ExportRow) {
        let Some(d) = self.datasets.last_mut() else {
            return;
        };
        d.eval_rows += 1;
        if d.last_eval_id.as_deref() != Some(row.row.id.as_str()) {
            d.eval_items += 1;
            d.last_eval_id = Some(row.row.id.clone());
        }
    }

    /// Takes the dataset's queue counts from `status`.
    pub fn end_dataset(&mut self, status: Option<&StatusReport>) {
        let Some(d) = self.datasets.last_mut() else {
            return;
        };
        d.queue = status.and_then(|s| {
            let q = s.datasets.iter().find(|x| x.name == d.dataset)?;
            Some(QueueCounts {
                source: if s.running { "endpoint" } else { "queue" }.into(),
                input_rows: q.items + q.rejected,
                items: q.items,
                done: q.done,
                sharded: q.sharded,
                failed: q.failed,
                rejected: q.rejected,
                not_done: q.items.saturating_sub(q.done + q.failed),
            })
        });
    }

    /// Checks the identities (module docs).
    pub fn finish(&mut self) -> Result<()> {
        for d in &self.datasets {
            if d.kept + d.dropped_total() != d.rows_in {
                return Err(ExportError::broken(format!(
                    "{}: accounting does not add up: {} kept + {} dropped != {} rows read",
                    d.dataset,
                    d.kept,
                    d.dropped_total(),
                    d.rows_in
                )));
            }
            if let Some(q) = &d.queue {
                let sum = q.done + q.failed + q.not_done + q.rejected;
                if sum != q.input_rows {
                    return Err(ExportError::broken(format!(
                        "{}: the queue's counts do not add up: {} done + {} failed + {} not done + {} rejected != {} input rows",
                        d.dataset, q.done, q.failed, q.not_done, q.rejected, q.input_rows
                    )));
                }
                if q.source == "queue" && d.items_in_shards != q.sharded {
                    return Err(ExportError::broken(format!(
                        "{}: the sealed shards hold {} item(s) but the queue says {} were written to shards: run `spool verify`",
                        d.dataset,
                        d.items_in_shards,
                        q.sharded
                    )));
                }
            }
        }
        self.checked = true;
        Ok(())
    }

    /// Rows kept over all datasets.
    pub fn kept(&self) -> u64 {
        self.datasets.iter().map(|d| d.kept).sum()
    }

    /// The one line `spool export` ends with, per dataset.
    pub fn lines(&self) -> Vec<String> {
        self.datasets
            .iter()
            .map(|d| {
                let mut s = format!(
                    "{}: {} row(s) read = {} kept + {} dropped",
                    d.dataset,
                    d.rows_in,
                    d.kept,
                    d.dropped_total()
                );
                if !d.dropped.is_empty() {
                    let why: Vec<String> =
                        d.dropped.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                    s += &format!(" ({})", why.join(", "));
                }
                if !d.flagged.is_empty() {
                    let why: Vec<String> =
                        d.flagged.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                    s += &format!("; flagged {}", why.join(", "));
                }
                if d.truncated_kept > 0 {
                    s += &format!("; {} kept cut by max_tokens (marked)", d.truncated_kept);
                }
                if d.end_of_turn_appended > 0 {
                    s += &format!("; end-of-turn id appended to {}", d.end_of_turn_appended);
                }
                if d.eval_rows > 0 {
                    s += &format!(
                        "; held out for eval: {} row(s) of {} item(s)",
                        d.eval_rows, d.eval_items
                    );
                }
                match &d.queue {
                    Some(q) => s += &format!(
                        "; items: {} input row(s) = {} done ({} in sealed shards, {} with a kept row) + {} failed + {} rejected + {} not done",
                        q.input_rows, q.done, d.items_in_shards, d.items_kept, q.failed, q.rejected, q.not_done
                    ),
                    None => s += &format!(
                        "; items: {} in sealed shards, {} with a kept row (failed and rejected unknown: neither the queue nor a running process answered)",
                        d.items_in_shards, d.items_kept
                    ),
                }
                s
            })
            .collect()
    }

    /// The JSON summary written beside the output.
    pub fn summary_json(&self, out: &Path) -> Result<String> {
        let mut v = serde_json::to_value(self)?;
        v["out"] = serde_json::json!(out.display().to_string());
        v["spool_version"] = serde_json::json!(env!("CARGO_PKG_VERSION"));
        Ok(serde_json::to_string_pretty(&v)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    fn row(id: &str, completion: &str, finish: &str, reasoning: Option<&str>) -> ExportRow {
        prepare(
            ShardRow {
                id: id.into(),
                completion: completion.into(),
                finish_reason: finish.into(),
                reasoning: reasoning.map(Into::into),
                prompt_token_ids: Some(vec![1]),
                completion_token_ids: Some(vec![2]),
                ..ShardRow::default()
            },
            "server".into(),
            None,
        )
    }

    /// Each gate drops for its own reason, counted; a leftover think marker is flagged by
    /// default; the identity holds.
    #[test]
    fn gates_drop_and_count_by_reason() {
        let gates = Gates {
            exclude_finish: vec!["length".into()],
            ..Gates::default()
        };
        let mut acc = Accounting::new(Format::Sharegpt, &gates);
        acc.begin_dataset("d");
        let rows = [
            row("a", "fine", "stop", None),
            row("a", "cut", "length", None),
            row("b", "  ", "stop", None),
            row("c", "x </think> y", "stop", Some("t")),
            row("d", "no split <think>", "stop", None),
        ];
        let kept: Vec<String> = rows
            .into_iter()
            .filter_map(|r| acc.judge(&gates, Format::Sharegpt, r))
            .map(|r| r.row.completion)
            .collect();
        assert_eq!(kept, ["fine", "x </think> y", "no split <think>"]);
        let d = &acc.datasets[0];
        assert_eq!(
            (d.rows_in, d.kept, d.items_in_shards, d.items_kept),
            (5, 3, 4, 3)
        );
        assert_eq!(d.dropped["finish_reason=length"], 1);
        assert_eq!(d.dropped["empty"], 1);
        assert_eq!(d.flagged["leftover_think_markers"], 1);
        acc.finish().unwrap();
        assert!(acc.checked);
        let drop = Gates {
            think: ThinkGate::Drop,
            ..Gates::default()
        };
        assert_eq!(
            drop.verdict(
                Format::Sharegpt,
                &mut row("c", "x </think>", "stop", Some("t"))
            ),
            Some("leftover_think_markers".into())
        );
    }

    /// A stopped queue that sharded more items than the shards hold fails the export.
    #[test]
    fn items_missing_from_the_shards_fail_the_check() {
        let gates = Gates::default();
        let mut acc = Accounting::new(Format::Sharegpt, &gates);
        acc.begin_dataset("d");
        acc.judge(&gates, Format::Sharegpt, row("a", "x", "stop", None));
        acc.datasets[0].queue = Some(QueueCounts {
            source: "queue".into(),
            input_rows: 2,
            items: 2,
            done: 2,
            sharded: 2,
            ..QueueCounts::default()
        });
        let e = acc.finish().unwrap_err().to_string();
        assert!(e.contains("hold 1 item(s) but the queue says 2"), "{e}");
    }
}
