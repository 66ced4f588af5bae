//! What a dataset's kept rows hold, counted as they stream by: rows, items, tokens, why
//! generations ended, and the distributions of completion lengths and conversation turns —
//! what the `report` page and the `hf` card show.
//!
//! Invariants: memory is one counter per distinct completion length and per distinct turn
//! count (bounded by the longest completion and the longest conversation), plus one item's
//! samples at a time (an item's rows are contiguous); the counts are of the rows the sink
//! was given, so they equal what the export wrote.

use super::ExportRow;
use std::collections::BTreeMap;

/// The stop reason shown when the shards do not say (no `stop_reason` column or value).
pub const UNKNOWN: &str = "unknown";

/// One dataset's (or split's) counts.
#[derive(Debug, Clone, Default)]
pub struct DatasetStats {
    pub dataset: String,
    /// Generations.
    pub rows: u64,
    /// Prompts with at least one row.
    pub items: u64,
    /// Conversations: (item, sample) pairs with at least one row.
    pub conversations: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Rows by `finish_reason`.
    pub finish: BTreeMap<String, u64>,
    /// Rows by `stop_reason` ([`UNKNOWN`] where the shards do not say).
    pub stop: BTreeMap<String, u64>,
    /// Rows by completion length in tokens.
    pub lengths: BTreeMap<u32, u64>,
    /// Conversations by the number of generated turns they have here.
    pub turns: BTreeMap<u32, u64>,
    last_id: Option<String>,
    /// The current item's rows per sample.
    samples: BTreeMap<u32, u32>,
}

impl DatasetStats {
    pub fn new(dataset: &str) -> Self {
        DatasetStats {
            dataset: dataset.into(),
            ..Default::default()
        }
    }

    /// Counts one row (rows of an item come together).
    pub fn add(&mut self, row: &ExportRow) {
        let r = &row.row;
        if self.last_id.as_deref() != Some(r.id.as_str()) {
            self.end_item();
            self.items += 1;
            self.last_id = Some(r.id.clone());
        }
        *self.samples.entry(r.sample).or_default() += 1;
        self.rows += 1;
        self.prompt_tokens += u64::from(r.prompt_tokens);
        self.completion_tokens += u64::from(r.completion_tokens);
        *self.finish.entry(r.finish_reason.clone()).or_default() += 1;
        let stop = row.stop_reason.as_deref().unwrap_or(UNKNOWN);
        *self.stop.entry(stop.to_owned()).or_default() += 1;
        *self.lengths.entry(r.completion_tokens).or_default() += 1;
    }

    /// Counts the current item's conversations; call once the dataset's rows are in.
    pub fn end_item(&mut self) {
        for (_, n) in std::mem::take(&mut self.samples) {
            self.conversations += 1;
            *self.turns.entry(n).or_default() += 1;
        }
    }
}

/// One bar of a histogram: values in `lo..=hi`, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub lo: u64,
    pub hi: u64,
    pub count: u64,
}

/// The smallest of 1, 2, 5, 10, 20, 50, … that is at least `x`.
fn nice(x: u64) -> u64 {
    let mut step = 1u64;
    loop {
        for m in [1, 2, 5] {
            if step.saturating_mul(m) >= x {
                return step.saturating_mul(m);
            }
        }
        step = step.saturating_mul(10);
    }
}

/// `values` (value → count) in at most `max_buckets` bars of equal, round width starting
/// at 0 (width 1 when the values fit), empty bars between included.
pub fn histogram(values: &BTreeMap<u32, u64>, max_buckets: usize) -> Vec<Bucket> {
    let Some((&max, _)) = values.last_key_value() else {
        return Vec::new();
    };
    let max = u64::from(max);
    let width = nice((max + 1).div_ceil(max_buckets.max(1) as u64)).max(1);
    let n = (max / width + 1) as usize;
    let mut out: Vec<Bucket> = (0..n as u64)
        .map(|i| Bucket {
            lo: i * width,
            hi: i * width + width - 1,
            count: 0,
        })
        .collect();
    for (&v, &c) in values {
        out[(u64::from(v) / width) as usize].count += c;
    }
    // Leading empty bars say nothing (lengths rarely start at 0).
    let first = out.iter().position(|b| b.count > 0).unwrap_or(0);
    out.drain(..first);
    out
}

/// A bucket's label: `7`, or `100–199`.
pub fn label(b: &Bucket) -> String {
    if b.lo == b.hi {
        b.lo.to_string()
    } else {
        format!("{}–{}", b.lo, b.hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::export::rows::prepare;
    use crate::store::row::ShardRow;

    fn row(id: &str, sample: u32, turn: u32, tokens: u32, finish: &str) -> ExportRow {
        prepare(
            ShardRow {
                id: id.into(),
                sample,
                turn,
                completion_tokens: tokens,
                prompt_tokens: 10,
                finish_reason: finish.into(),
                ..ShardRow::default()
            },
            "".into(),
            None,
        )
    }

    /// Rows, items, conversations, tokens and reasons add up; turns are counted per
    /// (item, sample); a stop reason the shards do not carry is "unknown".
    #[test]
    fn counts_follow_the_rows() {
        let mut s = DatasetStats::new("d");
        for r in [
            row("a", 0, 0, 5, "stop"),
            row("a", 0, 1, 7, "stop"),
            row("a", 1, 0, 5, "length"),
            row("b", 0, 0, 120, "stop"),
        ] {
            s.add(&r);
        }
        let mut with_reason = row("c", 0, 0, 3, "stop");
        with_reason.stop_reason = Some("eos".into());
        s.add(&with_reason);
        s.end_item();
        assert_eq!((s.rows, s.items, s.conversations), (5, 3, 4));
        assert_eq!((s.prompt_tokens, s.completion_tokens), (50, 140));
        assert_eq!(s.finish["stop"], 4);
        assert_eq!((s.stop[UNKNOWN], s.stop["eos"]), (4, 1));
        assert_eq!(s.turns, BTreeMap::from([(1, 3), (2, 1)]));
        assert_eq!(s.lengths[&5], 2);
    }

    /// Bars have a round width, cover every value once, and start at the first non-empty
    /// one; small integer ranges get one bar per value.
    #[test]
    fn histograms_have_round_bars() {
        let v = BTreeMap::from([(3, 2), (150, 1), (999, 4)]);
        let h = histogram(&v, 20);
        assert_eq!(
            h[0],
            Bucket {
                lo: 0,
                hi: 49,
                count: 2
            }
        );
        assert_eq!(
            h.last().unwrap(),
            &Bucket {
                lo: 950,
                hi: 999,
                count: 4
            }
        );
        assert_eq!(h.iter().map(|b| b.count).sum::<u64>(), 7);
        assert_eq!(h.len(), 20);
        let t = BTreeMap::from([(2, 5), (3, 1)]);
        let h = histogram(&t, 20);
        assert_eq!(
            h,
            [
                Bucket {
                    lo: 2,
                    hi: 2,
                    count: 5
                },
                Bucket {
                    lo: 3,
                    hi: 3,
                    count: 1
                }
            ]
        );
        assert_eq!(
            (
                label(&h[0]),
                label(&Bucket {
                    lo: 0,
                    hi: 49,
                    count: 0
                })
            ),
            ("2".into(), "0–49".into())
        );
        assert!(histogram(&BTreeMap::new(), 20).is_empty());
    }
}
